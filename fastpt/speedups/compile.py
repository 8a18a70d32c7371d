"""`torch.compile` (`--compile`, `--compile-mode`, `--compile-scope`): the whole lesson in this file.

What it does: TorchDynamo captures Python code as graphs (AOTAutograd adds their backward);
Inductor fuses their element-wise ops into a few generated Triton (GPU) or C++ (CPU) kernels.
The modes (torch._inductor.list_mode_options):
- `default`: fusion only;
- `max-autotune-no-cudagraphs`: also benchmarks matmul kernels and tunes the generated ones;
- `reduce-overhead`: fusion plus CUDA graphs;
- `max-autotune`: both, so it records CUDA graphs too.
Only `reduce-overhead` and `max-autotune` record CUDA graphs (on CUDA; a CPU run has none).

Why it is faster: fewer kernel launches and fewer round trips through memory for the
element-wise work between matmuls (GELU, dropout, layer norm, residual adds). A CUDA graph
goes further: the CPU launches a whole recorded graph at once instead of one kernel at a time.

What it costs: the first step compiles (tens of seconds on a GPU, minutes on a small CPU;
`first_step_s` in results.json reports it apart from the measured steps, which leave it out),
evaluation compiles once more (no_grad and eval mode change the graph), and errors show up as
long traces. Replaces Lightning's `model = torch.compile(model)` before `Trainer.fit`.

The two scopes: what is compiled, and when each applies
-------------------------------------------------------
    # --compile-scope layers (the default): each transformer layer compiled in place
    compile_layers(model, mode, dynamic_tokens)            # one graph serves every layer
    # --compile-scope whole: the step's forward, loss and metric sums as one graph (one device)
    forward_loss = apply_compile(forward_loss, mode, fullgraph=True)

- `layers`, the default (PyTorch's recipe "regional compilation", torchtitan's): each
  transformer layer is compiled in place, with `fullgraph=True` so a graph break is an error;
  the embeddings, the head, the loss and the metric sums run eagerly around them. The layers
  are instances of one class with parameters of one shape, and Dynamo passes a module's
  parameters to its graph as inputs (`inline_inbuilt_nn_modules`, on by default), so the first
  layer's graph serves every layer: Dynamo traces and Inductor compiles one layer, not the
  stack, so the cold compile does not grow with depth (MiniLM's 6 layers on a 2-core AVX2 EPYC:
  17 s of compiling against the whole step's 52 s, at the same step time;
  scripts/results/compile-cache-cpu.md; `scripts/bench_single.py compile-cache` measures it). The layers hold
  nearly all of a step's work (matmuls, attention); what is lost is fusion across layer
  boundaries. Where: `Strategy.wrap` (strategies/base.py) on one device; DDP compiles the
  layers, then wraps the model (strategies/ddp.py); FSDP compiles each layer, then shards it
  (strategies/fsdp.py:apply_fsdp, torchtitan's order), without `fullgraph`.
- `whole`: the largest unit the strategy allows, for the GPU fast path, where a CUDA graph
  (`--compile-mode reduce-overhead`) records the whole step's forward and backward at once. On
  one device the step's forward, loss and metric sums (`step.make_forward_loss`'s function)
  are compiled as one function with `fullgraph=True` (`Strategy.compile_step`). Under DDP the
  model is compiled and then wrapped, which lets DDP's optimizer split the graph at
  gradient-bucket boundaries so communication overlaps the backward. It traces every layer
  again, so the cold compile grows with depth. FSDP refuses it: its all-gather / reduce-scatter
  hooks run between the layers and must stay outside the compiled graphs (config.py).
Either way AOTAutograd compiles the backward of what is compiled, and the optimizer step
(GradScaler, clipping, Adam) runs eagerly (with --fused-adam, as Adam's fused kernel). The
compiled layers or function leave the model's parameter names alone, so checkpoints
(`strategy.module`, the plain model) never carry an `_orig_mod.` prefix.

Shapes
------
The first graph is static, specialised to the sizes it saw. A call with a new size recompiles
once, with the dimensions that changed made symbolic ("automatic dynamic shapes"), and that graph
then serves every later size of those dimensions; a dimension that changes later (say the shorter
last batch) costs one more recompile. With fixed padding (`--pad-to max_length`) the token count
never changes. Where it varies (`--bucket`, `--pad-to longest`, `--pack`) the token dimension, and
only it, is marked dynamic on every batch (`mark_token_dim_dynamic`), and the layers are compiled
with dynamic shapes: one graph serves every length from the start.

CUDA graphs (`reduce-overhead`, `max-autotune`)
-----------------------------------------------
A graph is recorded once per distinct input shape (so it pays off with fixed padding, or with
`--pack --pack-multiple N`, which rounds every batch to a few sizes) and then replayed. What that
requires:
- static memory: every replay reads the same addresses, so each batch is first copied into the
  graph's input buffers (parameters stay where they are), and outputs come back in the graph's
  own buffers. Each replay overwrites the previous one's outputs: the step's metric sums are
  added into a fresh tensor (`sums + batch_sums` in `step.train_step`, `sums +=` in
  `evaluation.evaluate`) before the next call, and the loss is consumed by its backward;
- nothing that needs the host inside: no `.item()` (with `fullgraph=True` an error already), no
  CPU tensors, no input changed in place. A graph that breaks these rules runs without a CUDA
  graph (Inductor logs "skipping cudagraphs due to ..." with TORCH_LOGS=cudagraphs);
- memory: the recorded graphs share one memory pool (CUDA graph trees) that other work cannot
  use, and each recorded shape adds its own input buffers.
What is captured is what Inductor compiled; the input copy, gradient reduction under DDP/FSDP,
GradScaler, clipping and the optimizer step run eagerly between the replays.

What a compiled run sets while it lasts (`compiled_run_settings`, undone by `restore_settings`)
-------------------------------------------------------------------------------------------------
- The cache: torch.compile stores generated kernels and compiled graphs on disk, so a second run
  with the same graphs skips Inductor (the FX graph cache) and, if the graph qualifies,
  AOTAutograd's tracing and partitioning of the backward (the AOTAutograd cache); Dynamo still
  traces the Python code each run. results.json's `compile_cache` counts both caches' hits,
  misses and bypasses. fastpt keeps them in `<cache dir>/inductor-<uid>` (in the token cache's
  folder, `$FASTPT_CACHE_DIR` or `~/.cache/fastpt`) unless `TORCHINDUCTOR_CACHE_DIR` is already
  set. Those kernels are shared objects and Python modules that the run loads and executes, so
  they are kept where only this user can write, even when the cache folder is shared: a folder of
  this user's own (mode 0700), and no folder above it may be changed by another user either
  (`check_compile_cache`, files/trust.py's rule, of which FASTPT_TRUST_DIRS can lift only the part
  above the cache folder). Otherwise the run stops with one line before it starts.
  Inductor reads the variable each time it needs the folder (`torch._inductor.runtime.
  cache_dir_utils.cache_dir`), but that function also writes its default,
  `/tmp/torchinductor_<user>`, into the variable, and importing `torch._dynamo` calls it: so by
  the time a run gets here the variable is set. Only a value other than torch's default counts
  as the user's choice (`compile_cache_dir`).
- Autocast inside a compiled graph: the whole-step scope compiles the step function, which
  enters autocast itself, so Dynamo records `torch.amp._enter_autocast` / `_exit_autocast` in
  the graph. torch 2.13's AOTAutograd cache refuses ("bypasses") any graph calling a private
  function it does not list, so such a graph was traced and partitioned again on every run, warm
  cache or not (pytorch/pytorch#191106, allowed upstream by later torch). Their effect is fixed by
  their arguments (device, dtype, enabled), which are constants in the graph and so in its cache
  key: fastpt lists them in `torch._inductor.config.unsafe_marked_cacheable_functions`, the knob
  torch provides for this. (Layer by layer, autocast is entered outside the compiled regions and
  no graph holds these calls.)
- Float attributes are constants: `torch._dynamo.config.specialize_float` is on. A layer compiled
  with `dynamic=True` would otherwise turn every float attribute of its modules (layer-norm eps,
  dropout p, the attention scale) into a symbol, which Inductor cannot keep: it specialises them
  and restarts Dynamo's analysis ("tensorify" restart), so each layer graph was traced twice.
- On a CPU, one graph for every packed length: a float32 sum over more than 4,096 elements gets
  Inductor's chunked ("cascade") summation on a CPU; over fewer, a plain one. With the token
  count symbolic (packed or bucketed batches) that choice was made on the first batch's count and
  kept as a guard, `tokens <= 4096`: the first batch of more than 4,096 tokens (12 reviews at
  512, often) compiled the training layer a second time, half an epoch in. A sum whose size is
  unknown until it runs takes the chunked summation (right at any size: one chunk is the plain
  sum) and adds no guard (`_chunked_sum_without_guard`).
- On a CPU, dropout masks: Inductor draws its own random numbers inside its kernels unless
  `torch._inductor.config.fallback_random` is on, and on a CPU its own were 2-3x slower than
  eager's `bernoulli_` (docs/results.md, 'Questions answered'). It is on: the graph calls
  `bernoulli_` as eager does, in the same order from the same generator, so a compiled run draws
  the masks an eager one would (tests/test_speedups.py compares the two steps with dropout on).
  On CUDA Inductor's own (Philox, in the kernel) stay.
- On a CPU, Inductor's checks of the vector instruction sets (test kernels built and loaded in
  new processes, 1-3 s of every compiled start on 2 cores) pass once per machine, torch and
  compiler: the ones that passed are cached under `<cache dir>/vec-isa/` and not made again
  (`_vector_isa_checks_cached`).
"""

import contextlib
import hashlib
import math
import os
import shutil
import sys
from pathlib import Path

import torch


TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")  # the tensors whose dim 1 is tokens


def compile_options(mode: str = "default", dynamic: bool | None = None, fullgraph: bool = False) -> dict:
    """torch.compile's keyword arguments for --compile-mode (one place for the mapping)."""
    return {"mode": None if mode == "default" else mode, "dynamic": dynamic, "fullgraph": fullgraph}


def apply_compile(target, mode: str = "default", fullgraph: bool = False):
    """The whole scope: `target` (a function or a module) compiled by TorchDynamo + Inductor.

    `dynamic=None`: sizes start static; the dimensions `mark_token_dim_dynamic` marks are
    symbolic from the first call.
    """
    return torch.compile(target, **compile_options(mode, fullgraph=fullgraph))


def transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks: DistilBERT's, BERT's (MiniLM), RoBERTa's encoder layers (also inside PackedClassifier)."""
    if hasattr(model, "distilbert"):
        return list(model.distilbert.transformer.layer)
    prefix = getattr(model, "encoder_name", None) or getattr(model, "base_model_prefix", "")  # PackedClassifier's, HF's
    encoder = getattr(getattr(model, prefix, None), "encoder", None)
    if hasattr(encoder, "layer"):  # BERT (MiniLM), RoBERTa and the other BERT-style encoders
        return list(encoder.layer)
    raise ValueError(f"fastpt does not know where the transformer layers of {type(model).__name__} are")


def compile_layers(model: torch.nn.Module, mode: str = "default", dynamic_tokens: bool = False,
                   fullgraph: bool = True) -> torch.nn.Module:
    """The layers scope (regional compilation): each transformer layer compiled in place
    (`Module.compile`); `model` is returned.

    In place, so parameter names (and checkpoints) do not change. A layer's input is a hidden
    state computed eagerly, not the input ids `mark_token_dim_dynamic` marks, so where lengths
    vary (`dynamic_tokens`) the layers are compiled with dynamic shapes from the start: one graph
    for every length instead of a static first graph and a recompile.
    """
    for layer in transformer_layers(model):
        layer.compile(**compile_options(mode, dynamic=True if dynamic_tokens else None, fullgraph=fullgraph))
    return model


def mark_token_dim_dynamic(batch: dict) -> dict:
    """Compile the token dimension as a symbol: one graph for every batch length, no recompiles."""
    for key in batch.keys() & TOKEN_KEYS:
        torch._dynamo.mark_dynamic(batch[key], 1)
    return batch


def check_compile_supported() -> None:
    """Fail early, with one line, where TorchDynamo cannot run."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the interpreter
        raise ValueError(f"--compile is not supported here: {e}") from None
    if not torch._dynamo.is_dynamo_supported():  # pragma: no cover
        raise ValueError(f"--compile is not supported on Python {sys.version.split()[0]} "
                         f"with torch {torch.__version__}")


# --------------------------------------------------------------------------- a compiled run's settings

CHUNK = 4096  # Inductor's chunk for a float32 sum on a CPU (torch/_inductor/codegen/cpp.py)

# Dynamo's names for entering and leaving an autocast region inside a graph (torch/_dynamo/variables/ctx_manager.py).
AUTOCAST_CALLS = ("torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast")

_undo = contextlib.ExitStack()  # puts each setting back as the run found it, at restore_settings()


def compiled_run_settings(device: torch.device, cache_root: Path) -> None:
    """The process-wide settings of a compiled run (see the module's docstring), set before anything compiles."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    _undo.callback(_set_env, "TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir(cache_root)
    cacheable = {**inductor_config.unsafe_marked_cacheable_functions,
                 **{name: torch.__version__ for name in AUTOCAST_CALLS}}
    _undo.enter_context(dynamo_config.patch(specialize_float=True))
    _undo.enter_context(inductor_config.patch(unsafe_marked_cacheable_functions=cacheable))
    if device.type == "cpu":
        _undo.enter_context(inductor_config.patch(fallback_random=True))
        _chunked_sum_without_guard()
        _vector_isa_checks_cached(cache_root)


def restore_settings() -> None:
    """The settings as `compiled_run_settings` found them (nothing if it did not run)."""
    _undo.close()


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


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


def _vector_isa_checks_cached(cache_root: Path) -> None:
    """Inductor's checks of the CPU's vector instruction sets, each made once per machine, torch and
    C++ compiler while this run lasts: a check that passed is cached, as the matmul peak is.

    Before its first C++ kernel of a process, Inductor builds a test kernel for each instruction
    set the CPU lists (AVX512 and its VNNI and BF16 parts, AVX2) and loads each in a new Python
    process: six builds and loads, 2.9 s of a warm compiled start on this 2-core CPU
    (pytorch/pytorch#100378). A check that passed on this machine passes again, so its verdict is
    kept under `<cache dir>/vec-isa/` and answered from there; one that failed is made again in
    every run. Inductor picks the same instruction set and flags either way, so its kernels and
    their cache keys do not change.
    """
    from fastpt.monitoring import peak

    try:
        from torch._inductor import cpp_builder, cpu_vec_isa
        compiler = shutil.which(cpp_builder.get_cpp_compiler())
        own = cpu_vec_isa.VecISA.check_build
    except (ImportError, AttributeError):  # pragma: no cover - another torch's layout: its own checks run
        return
    if compiler is None:
        return  # Inductor's own check says what is missing
    built = os.stat(compiler)
    key = {"cpu": peak.cpu_identity(), "torch": torch.__version__, "torch_path": os.path.dirname(torch.__file__),
           "compiler": [os.path.realpath(compiler), built.st_size, built.st_mtime_ns]}
    path = peak.cache_path(cache_root, "vec-isa", key)
    passed = set((peak.read_cached(path, key) or {}).get("passed", []))

    def check_build(isa, code: str) -> bool:
        check = f"{isa} [{isa.build_arch_flags()}] {hashlib.sha1(code.encode()).hexdigest()[:12]}"
        if check in passed:
            return True
        if not own(isa, code):
            return False
        passed.add(check)
        peak.write_cached(path, {"key": key, "passed": sorted(passed)})
        return True

    cpu_vec_isa.VecISA.check_build = check_build
    _undo.callback(setattr, cpu_vec_isa.VecISA, "check_build", own)


def _chunked_sum_without_guard() -> None:
    """Inductor's CPU kernels: a float32 sum of a size known only at run time uses the chunked
    summation, without guarding on the size, until restore_settings() puts Inductor's own rule back."""
    try:
        from torch._inductor.codegen.cpp import CppKernel
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover - another torch's layout: its own rule stays
        return
    own = CppKernel.need_use_acc_helper

    def need_use_acc_helper(self, reduction_type, dtype, use_scalar):
        if reduction_type == "sum" and dtype == torch.float and getattr(self, "call_ranges", None) is not None:
            size = math.prod(self.call_ranges[self.reduction_depth:])
            sizes = V.graph.sizevars
            if not (sizes.statically_known_leq(size, CHUNK) or sizes.statically_known_gt(size, CHUNK)):
                return True
        return own(self, reduction_type, dtype, use_scalar)

    CppKernel.need_use_acc_helper = need_use_acc_helper
    _undo.callback(setattr, CppKernel, "need_use_acc_helper", own)
