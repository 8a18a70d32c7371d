"""--pack on RoBERTa-style models: positions from the padding index + 1, the head on token 0."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, RobertaConfig

from fastpt.inputs.data import Collator
from fastpt.speedups.packing import PackedClassifier, PackedCollator, packed_logits


MAX_LENGTH = 40
PAD = 1  # RoBERTa's <pad>: positions start at 2


def tiny_roberta():
    torch.manual_seed(0)
    config = RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=MAX_LENGTH + PAD + 1, pad_token_id=PAD,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize("kernel", ["loop", "mask"])
def test_packed_roberta_matches_padded_logits_and_gradients(kernel):
    reference = tiny_roberta().eval()
    packed = PackedClassifier(copy.deepcopy(reference), kernel).eval()
    rng = np.random.default_rng(0)
    items = [(rng.integers(3, 100, size=n).astype(np.int32), 0, 1.0) for n in (7, MAX_LENGTH, 2, 23)]
    padded = Collator(PAD, "longest", MAX_LENGTH)(items)
    weights = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))

    expected = reference(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
    (expected * weights).sum().backward()
    got = packed_logits(packed, PackedCollator(PAD)(items), MAX_LENGTH)
    (got * weights).sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    grads = dict(packed.named_parameters())
    for name, p in reference.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
