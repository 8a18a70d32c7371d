"""Process-wide switches, set in one place before anything runs: TF32, deterministic algorithms,
and where (and what) compiled kernels are cached.

- `--tf32`: float32 matmuls on Ampere and newer GPUs run on tensor cores with a 10-bit
  mantissa (TF32): up to 8x the float32 rate, at about bfloat16-like input precision. Off by
  default: PyTorch's own default for matmuls (`torch.backends.cuda.matmul.allow_tf32` is False),
  while `torch.backends.cudnn.allow_tf32` defaults to True; fastpt sets both to `--tf32` on CUDA.
  With `--amp` most matmuls are 16-bit anyway.
- Not here: `torch.backends.cudnn.benchmark`, often listed as a speed switch. It lets cuDNN time
  its convolution algorithms for each new input shape and keep the fastest; a transformer
  classifier has no convolutions, so it would change nothing. (`cudnn.allow_tf32` follows
  `--tf32` only for completeness: it too concerns convolutions alone.)
- `--deterministic`: `torch.use_deterministic_algorithms(True)` (Lightning's
  `deterministic=True`): bitwise-repeatable runs, at a measured cost in speed. It is
  process-wide, so `restore()` turns it back off when the run ends.
- The Inductor cache: `torch.compile` stores generated kernels and compiled graphs on disk
  and reuses them when the same graph comes again, so a second run skips most of the compile.
  fastpt keeps them in `<cache dir>/inductor-<uid>` (in the token cache's folder,
  `$FASTPT_CACHE_DIR` or `~/.cache/fastpt`) unless `TORCHINDUCTOR_CACHE_DIR` is already set.
  Those kernels are shared objects and Python modules that the run loads and executes, so they
  are kept where only this user can write, even when the cache folder is shared: a folder of
  this user's own (mode 0700), and no folder above it may be changed by another user either
  (`check_compile_cache`, files/trust.py's rule, of which FASTPT_TRUST_DIRS can lift only the
  part above the cache folder). Otherwise the run stops with one line before it starts. Inductor reads the
  variable each time it needs the folder (`torch._inductor.runtime.cache_dir_utils.cache_dir`),
  but that function also writes its default, `/tmp/torchinductor_<user>`, into the variable, and
  importing `torch._dynamo` calls it: so by the time a run gets here the variable is set. Only a
  value other than torch's default counts as the user's choice (`compile_cache_dir`).
- Autocast inside a compiled graph: `--compile-scope whole` compiles the step function, which
  enters autocast itself, so Dynamo records `torch.amp._enter_autocast` / `_exit_autocast` in
  the graph. torch 2.13's AOTAutograd cache refuses ("bypasses") any graph calling a private
  function it does not list, so such a graph was traced and partitioned again on every run, warm
  cache or not (pytorch/pytorch#191106, allowed upstream by later torch). Their effect is fixed by
  their arguments (device, dtype, enabled), which are constants in the graph and so in its cache
  key: fastpt lists them in `torch._inductor.config.unsafe_marked_cacheable_functions`, the knob
  torch provides for this, while the run lasts. (Layer by layer, autocast is entered outside the
  compiled regions and no graph holds these calls.)
- Float attributes are constants: `torch._dynamo.config.specialize_float` is on while a compiled
  run lasts. A layer compiled with `dynamic=True` (`--compile-scope layers` and FSDP where lengths
  vary) would otherwise turn every float attribute of its modules (layer-norm eps, dropout p, the
  attention scale) into a symbol, which Inductor cannot keep: it specialises them and restarts
  Dynamo's analysis ("tensorify" restart), so each layer graph was traced twice, cold or warm.
- One graph for every packed length on a CPU. A float32 sum over more than 4,096 elements gets
  Inductor's chunked ("cascade") summation on a CPU; over fewer, a plain one. With the token
  count symbolic (packed or bucketed batches) that choice was made on the first batch's count and
  kept as a guard, `tokens <= 4096`: the first batch of more than 4,096 tokens (12 reviews at
  512, often) compiled the training layer a second time, half an epoch in. While a compiled CPU
  run lasts, a sum whose size is unknown until it runs takes the chunked summation (right at any
  size: one chunk is the plain sum) and adds no guard (`_chunked_sum_without_guard`).
- Dropout masks in a compiled CPU graph: Inductor draws its own random numbers inside its kernels
  unless `torch._inductor.config.fallback_random` is on, and on a CPU its own were 2-3x slower
  than eager's `bernoulli_` (scripts/results/dropout-masks-cpu.md). While a compiled CPU run lasts
  it is on: the graph calls `bernoulli_` as eager does, in the same order from the same generator,
  so a compiled run draws the masks an eager one would (tests/test_speedups.py compares the two
  steps with dropout on). On CUDA Inductor's own (Philox, in the kernel) stay.
"""

from __future__ import annotations

import functools
import operator
import os
from pathlib import Path

import torch


def configure(cfg, device: torch.device, cache_root: Path) -> None:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    if cfg.compile:
        _before_run["TORCHINDUCTOR_CACHE_DIR"] = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir(cache_root)
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        _before_run["specialize_float"] = dynamo_config.specialize_float
        dynamo_config.specialize_float = True
        _before_run["cacheable"] = dict(inductor_config.unsafe_marked_cacheable_functions)
        inductor_config.unsafe_marked_cacheable_functions = {
            **inductor_config.unsafe_marked_cacheable_functions, **{name: torch.__version__ for name in AUTOCAST_CALLS}}
        if device.type == "cpu":
            _chunked_sum_without_guard(True)
            _before_run["fallback_random"] = inductor_config.fallback_random
            inductor_config.fallback_random = True


def _chunked_sum_without_guard(on: bool) -> None:
    """Inductor's CPU kernels: a float32 sum of a size known only at run time uses the chunked
    summation, without guarding on the size (on), or Inductor's own rule again (off)."""
    try:
        from torch._inductor.codegen.cpp import CppKernel
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover - another torch's layout: its own rule stays
        return
    own = getattr(CppKernel.need_use_acc_helper, "inductors_own", CppKernel.need_use_acc_helper)
    if not on:
        CppKernel.need_use_acc_helper = own
        return

    def need_use_acc_helper(self, reduction_type, dtype, use_scalar):
        if reduction_type == "sum" and dtype == torch.float and getattr(self, "call_ranges", None) is not None:
            size = functools.reduce(operator.mul, self.call_ranges[self.reduction_depth:])
            sizes = V.graph.sizevars
            if not (sizes.statically_known_leq(size, CHUNK) or sizes.statically_known_gt(size, CHUNK)):
                return True
        return own(self, reduction_type, dtype, use_scalar)

    need_use_acc_helper.inductors_own = own
    CppKernel.need_use_acc_helper = need_use_acc_helper


CHUNK = 4096  # Inductor's chunk for a float32 sum on a CPU (torch/_inductor/codegen/cpp.py)

# Dynamo's names for entering and leaving an autocast region inside a graph (torch/_dynamo/variables/ctx_manager.py).
AUTOCAST_CALLS = ("torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast")


def compile_cache_dir(cache_root: Path) -> str:
    """Where Inductor caches this run's kernels: TORCHINDUCTOR_CACHE_DIR if the user chose it, else
    <cache root>/inductor-<uid>: each user's own, also in a cache folder a team shares."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):  # torch's own default
        return str(cache_root / f"inductor-{os.getuid()}")
    return chosen


def check_compile_cache(cache_root: Path) -> None:
    """Create this user's compile cache (0700) if needed; ValueError, before the run starts, if it or a
    folder above it is another user's or can be changed by others: the kernels there would run as this user.
    A folder the user chose (TORCHINDUCTOR_CACHE_DIR) is theirs to vouch for."""
    from fastpt.files import trust

    folder = Path(compile_cache_dir(cache_root))
    if folder != cache_root / f"inductor-{os.getuid()}":
        return
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the compile cache {folder}: {e.strerror or e}") from None
    own = trust.problem(folder)  # the kernels' own folder: this user's, trusted folder or not
    found = f"{folder} {own}" if own else trust.chain_problem(folder.parent)
    if found is not None:
        raise ValueError(f"refused the compile cache {folder}: {found}; compiled kernels run as you, so fastpt keeps "
                         f"them only where no one else can change them. Set TORCHINDUCTOR_CACHE_DIR to a folder of "
                         f"your own, or choose another --cache-dir")


_before_run: dict = {}  # the variable as the run found it, put back by restore()


def restore(cfg) -> None:
    if cfg.deterministic:
        torch.use_deterministic_algorithms(False)
    if "cacheable" in _before_run:
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        dynamo_config.specialize_float = _before_run.pop("specialize_float")
        inductor_config.unsafe_marked_cacheable_functions = _before_run.pop("cacheable")
        _chunked_sum_without_guard(False)
        if "fallback_random" in _before_run:
            inductor_config.fallback_random = _before_run.pop("fallback_random")
    if "TORCHINDUCTOR_CACHE_DIR" in _before_run:
        previous = _before_run.pop("TORCHINDUCTOR_CACHE_DIR")
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
