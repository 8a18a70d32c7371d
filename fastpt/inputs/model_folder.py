"""A local model folder checked before it is loaded: the files transformers will read, and what they hold.

`--model /local/folder` (and fastpt-predict's folder) loads whatever `from_pretrained` finds
there. Checked first, cheaply, each fault stops the run with one line before the data is
tokenised or memory of the model's size is allocated: a config.json that is no JSON object or
asks for a model larger than this machine's memory, a missing or damaged weight file, an index
naming files outside the folder, a pickle holding objects other than tensors (never unpickled:
weights_only=True), weights whose shapes or number of layers the config does not make.
"""

import json
import os
import pickle
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForSequenceClassification

from fastpt.errors import ModelError, one_line


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
        if not (folder / name).is_file():
            continue
        if not name.endswith(".index.json"):
            return [_inside(folder, name)]
        try:
            shards = sorted(set(json.loads((folder / name).read_text())["weight_map"].values()))
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
        raise ModelError(f"model folder {folder}: config.json is not readable JSON "
                         f"({one_line(e, limit=120)})") from None
    if not isinstance(config, dict):
        raise ModelError(f"model folder {folder}: config.json holds no JSON object")
    return config


def check_model_folder(folder: Path, weights: bool = True) -> None:
    """A model folder that loads as it says: its config's size fits this machine's memory and, with
    `weights`, the files transformers will load are whole, hold tensors only and have the config's shapes.
    ModelError naming the first difference, before anything of the model's size is allocated."""
    _config_json(folder)  # a damaged config.json is named as such
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - each config class validates its fields with errors of its own
        raise ModelError(f"cannot load a config from {str(folder)!r}: {one_line(e, limit=200)}") from None
    check_model_size(folder, config)
    if weights:
        check_weight_shapes(folder, config, check_weight_files(folder))


# The config fields that size an encoder (DistilBERT names two of them its own way: dim, hidden_dim).
SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings")


def _shown_sizes(config) -> str:
    return ", ".join(f"{name} {getattr(config, name)}" for name in SIZE_FIELDS
                     if getattr(config, name, None) is not None)


def check_model_size(folder: Path, config) -> None:
    """The parameters the config makes, counted from its sizes (embedding tables, then per layer attention's
    4 h x h and the feed-forward's 2 h x ffn), against this machine's memory in float32: a config asking for
    more would fail in the allocator after minutes, or be killed."""
    sizes = {field: getattr(config, field, None) for field in SIZE_FIELDS}
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", None)
    for field, value in {**sizes, "intermediate size": ffn}.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ModelError(f"model folder {folder}: config.json's {field} is {value!r}, not a positive whole "
                             f"number")
    if None in sizes.values():
        return  # not a BERT-style encoder's config: transformers' own checks apply
    vocab, h, layers, positions = sizes.values()
    parameters = (vocab + positions) * h + layers * (4 * h * h + 2 * h * (ffn or 4 * h))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 4 * parameters > memory:
        raise ModelError(f"model folder {folder}: its config.json ({_shown_sizes(config)}) makes a model of about "
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
            raise ModelError(f"model folder {folder}: config.json ({_shown_sizes(config)}) does not fit its weights: "
                             f"{key} is {list(shape)} there, the config makes it {list(expected[name])}; download "
                             f"or save the model again")


def check_weight_files(folder: Path) -> dict:
    """The weight files transformers will load (`weight_files`) are whole, and hold tensors only; ModelError
    if not. Returns {name: shape} of what they hold.

    Cheap: a safetensors file's header is read and checked against the file's size; a
    pytorch_model.bin is unpickled with weights_only=True (tensors memory-mapped, not read), so a
    crafted pickle is refused here, before the data work, and never runs."""
    return {key: shape for path in weight_files(folder) for key, shape in _weight_shapes(folder, path).items()}


def _weight_shapes(folder: Path, path: Path) -> dict:
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                return {key: f.get_slice(key).get_shape() for key in f.keys()}
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # a file in torch's legacy format cannot be memory-mapped
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ModelError(f"model folder {folder}: {path.name} holds objects other than tensors, which fastpt "
                         f"does not unpickle (weights_only=True); convert a trusted copy to safetensors") from None
    except (SafetensorError, RuntimeError, OSError, EOFError) as e:
        cause = str(e).removeprefix("Error while deserializing header: ") or e.__class__.__name__
        raise ModelError(f"model folder {folder}: {path.name} is damaged ({one_line(cause, limit=120)}); "
                         f"download or save it again") from None
    if not isinstance(state, dict):
        raise ModelError(f"model folder {folder}: {path.name} holds no weights by name (a {type(state).__name__})")
    return {key: tuple(value.shape) for key, value in state.items() if torch.is_tensor(value)}
