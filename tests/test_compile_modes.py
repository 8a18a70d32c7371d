"""--compile-mode's choices against the installed torch: every one is a mode Inductor knows, and the
ones compile.py says record CUDA graphs are exactly those whose options turn them on."""

from __future__ import annotations

import pytest

from fastpt.config import CHOICES


list_mode_options = pytest.importorskip("torch._inductor").list_mode_options


def test_compile_mode_choices_and_which_record_cuda_graphs():
    options = {mode: list_mode_options(mode) for mode in CHOICES["compile_mode"]}  # raises on an unknown mode
    assert {mode for mode, opts in options.items() if opts.get("triton.cudagraphs")} == {
        "reduce-overhead", "max-autotune"}
    assert options["max-autotune-no-cudagraphs"]["max_autotune"]
