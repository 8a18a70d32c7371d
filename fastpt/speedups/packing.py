"""Padding-free ("packed") batches.

What it does: a packed batch holds the same B reviews as a padded batch, laid end to end as
one token stream `input_ids[1, T]`, with `cu_seqlens` (where each review starts and ends) and
`position_ids` that restart at 0 for each review. Attention stays inside each review (a
registered Hugging Face attention function, see `packed_attention`), every other layer works
token by token anyway, and the classification head reads each review's first token ([CLS]),
gathered at `cu_seqlens[:-1]`.

Why it is faster: no pad token is ever computed. Padded to 512, IMDB batches are about half
padding (bucketing.py gives the shares); padded to their own longest, random batches still are.
Attention gains more than the padding share: it is quadratic in length, and each review only
pays for its own length squared instead of the batch's longest.

What it costs:
- Packed attention applies no attention-probability dropout, on every device: the CUDA kernel
  (`varlen_attn`) has no dropout argument, and the CPU kernels follow it so that CPU and GPU
  packed runs compute the same thing. All other dropout (embeddings, hidden states, the
  classifier) is unchanged. The models' attention dropout is 0.1 by default, so packed runs are
  regularised a little less. On 2,000 real reviews with MiniLM (scripts/results/pack-accuracy-cpu.md)
  test accuracy was within noise of random padded batches (+0.37 +- 0.25 points, seed by seed).
- Each batch has its own total length T, so a compiled graph sees a new shape every batch:
  the token dimension is marked dynamic before the step (`Strategy.to_device`), so one compiled
  graph serves every length; `PackedCollator(multiple=...)` rounds T up so that CUDA graphs,
  which record one graph per distinct shape, see only a few shapes. The rounding tokens belong
  to no review and change no review's output.
- The model is called through `PackedClassifier`, not the Hugging Face classification forward
  (which reads token 0 of each row). Its state dict is the plain model's, key for key.

The attention kernels (`packed_attention.py`: FlashAttention's varlen on CUDA, a per-review
loop of SDPA calls, a block-diagonal mask), all exact; `--pack-attention` picks one, by default
`packed_attention_kernel`'s rule (the loop on a CPU, varlen on CUDA in fp16/bf16).

Lightning has no flag for this. In Hugging Face it is `DataCollatorWithFlattening` (padding-free
training: one row, `position_ids` restarting per example) with a flash-attention implementation.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fastpt.speedups.packed_attention import KERNELS, apply_packed_attention


# --------------------------------------------------------------------------- the batch

class PackedCollator:
    """Lays a batch of (tokens, label, weight) items end to end as one row of tokens.

    With `multiple`, the row is padded to a multiple of it with `pad_id` tokens placed after the
    last review; they belong to no review (`cu_seqlens[-1]` is the number of real tokens).
    `max_length` is the `max_seqlen` the attention kernels are promised: no review, and no rounding
    tail (fewer than `multiple` tokens, one more sequence for the "varlen" kernel), may exceed it.
    """

    def __init__(self, pad_id: int, multiple: int | None = None, max_length: int | None = None):
        if multiple is not None and multiple < 1:
            raise ValueError(f"multiple must be a positive number of tokens, got {multiple}")
        if multiple is not None and max_length is not None and multiple > max_length:
            raise ValueError(f"multiple {multiple} exceeds max_length {max_length}: "
                             "the rounding tail must fit in one attention sequence")
        self.pad_id, self.multiple, self.max_length = pad_id, multiple, max_length

    def __call__(self, items) -> dict:
        tokens, labels, weights = zip(*items)
        lengths = np.array([len(review) for review in tokens], dtype=np.int64)
        if (lengths == 0).any():
            raise ValueError("an empty review cannot be packed: it has no first token to classify")
        if self.max_length is not None and lengths.max() > self.max_length:
            raise ValueError(f"a review of {lengths.max()} tokens exceeds max_length {self.max_length}")
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
        num_real_tokens = int(cu_seqlens[-1])
        num_tokens = -(-num_real_tokens // self.multiple) * self.multiple if self.multiple else num_real_tokens
        tail = (0, num_tokens - num_real_tokens)  # the rounding tokens: pad_id, each at position 0
        input_ids = np.pad(np.concatenate(tokens).astype(np.int64), tail, constant_values=self.pad_id)
        position_ids = np.pad(np.arange(num_real_tokens) - np.repeat(cu_seqlens[:-1], lengths), tail)
        return {
            "input_ids": torch.from_numpy(input_ids)[None],
            "position_ids": torch.from_numpy(position_ids)[None],
            "cu_seqlens": torch.from_numpy(cu_seqlens.astype(np.int32)),
            "labels": torch.tensor(labels, dtype=torch.long),
            "weight": torch.tensor(weights, dtype=torch.float32),
            "lengths": lengths.tolist(),  # Python ints, for the throughput meter: no tensor read
            "num_tokens": num_tokens,
        }


def is_packed(batch) -> bool:
    return "cu_seqlens" in batch


# --------------------------------------------------------------------------- the model

PACKED_MODELS = ("distilbert", "bert", "roberta")  # the architectures PackedClassifier knows the heads of


class PackedClassifier(nn.Module):
    """A `...ForSequenceClassification` model run on packed batches.

    RoBERTa-style models number positions from the padding index + 1 (`<pad>` is 1, so the first
    token sits at position 2): the packed stream's per-review positions are shifted by as much.

    It registers the model's own children (`distilbert`, `pre_classifier`, ... or `bert`,
    `dropout`, `classifier`) under their own names, so it shares every parameter with the model
    and its `state_dict()` has exactly the model's keys: checkpoints saved from it load into a
    plain `AutoModelForSequenceClassification`.
    This module, not the Hugging Face one, is what gets compiled and wrapped in DDP.
    `kernel` is one of packed_attention.KERNELS; `choice` says how it was chosen (--pack-attention,
    or the device's rule), for results.json.
    """

    def __init__(self, model: nn.Module, kernel: str = "loop", choice: dict | None = None):
        super().__init__()
        if model.config.model_type not in PACKED_MODELS:
            raise ValueError(f"packed batches support {', '.join(PACKED_MODELS)} models, "
                             f"not {model.config.model_type}")
        if kernel not in KERNELS:
            raise ValueError(f"unknown packed attention kernel {kernel!r}; choose one of {KERNELS}")
        apply_packed_attention(model)
        for name, child in model.named_children():
            self.add_module(name, child)
        self.config, self.kernel = model.config, kernel
        self.kernel_choice = choice or {"kernel": kernel}  # how it was chosen (results.json's pack_attention)
        self.encoder_name = model.base_model_prefix

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        encoder = getattr(self, self.encoder_name)
        # An explicit all-zero segment: the models' default buffer is only max_position_embeddings long.
        extra = {"token_type_ids": torch.zeros_like(input_ids)} if hasattr(self.config, "type_vocab_size") else {}
        if self.config.model_type == "roberta":
            position_ids = position_ids + self.config.pad_token_id + 1  # what create_position_ids_from_input_ids gives
        hidden = encoder(input_ids=input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens,
                         max_seqlen=max_seqlen, packed_kernel=self.kernel, **extra).last_hidden_state
        first_tokens = hidden[0].index_select(0, cu_seqlens[:-1])  # [B, hidden]: each review's [CLS]
        return self.head(first_tokens)

    def head(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """The architecture's own classification head, as its forward applies it to token 0."""
        if self.config.model_type == "distilbert":
            x = self.dropout(F.relu(self.pre_classifier(first_tokens)))
        elif self.config.model_type == "roberta":
            return self.classifier(first_tokens[:, None])  # RobertaClassificationHead reads token 0 itself
        else:
            pooler = getattr(self, self.encoder_name).pooler  # dense + tanh; it reads [:, 0]
            x = self.dropout(pooler(first_tokens[:, None]))
        return self.classifier(x)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside torch.compile's (`_orig_mod`), DDP's or DeepSpeed's (`module`) wrapper."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def packed_logits(model: nn.Module, batch: dict, max_seqlen: int) -> torch.Tensor:
    """Logits [B, num_labels] of a packed batch; `model` is a PackedClassifier, maybe compiled / in DDP.

    `max_seqlen` is a static bound on one review's length (the run's max length), a Python int,
    so that a compiled graph never specialises on a per-batch value.
    """
    if not isinstance(unwrap(model), PackedClassifier):
        raise TypeError("packed_logits needs a PackedClassifier (or a compiled / DDP wrapper of one)")
    return model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], max_seqlen)
