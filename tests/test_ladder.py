"""The teaching ladder (scripts/ladder/): every script runs, adds only its own tagged lines, and
computes exactly what train.py computes with the same flags.

- Shape: each script is the one its docstring builds on plus a short diff whose every new or
  changed line carries the script's own rung tag (`# [06]` in 06_ddp.py; docstring and blank
  lines aside). Lines it keeps are kept byte for byte, earlier rungs' tags included, so `diff`
  shows only the new rung and a search for `[06]` follows DDP through 07 and 08. The script a
  rung builds on is the one it differs least from (07 and 08 on 06, 09 on 05); each lesson and
  each script stays short.
- Started the wrong way (06-08 without torchrun, 07 in float16 on the CPU), a script says how
  to start it in one line and exits with status 2.
- Single process, run in this process (no interpreter start-up per script): 01, 02, 03, 05 and
  09 print, step by step, the losses train.py logs to TensorBoard with the same flags (float32,
  bfloat16 autocast, data-loader workers, early stopping over two epochs), and the same
  validation and test numbers; 04 (torch.compile, slow) prints train.py --compile's.
- Two gloo processes, one torchrun launch: 06 (DDP) prints train.py --ddp's losses; 07
  (DeepSpeed ZeRO-2) and 08 (FSDP2) follow them. The launch runs this file as its driver.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib
import io
import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
LADDER = ROOT / "scripts" / "ladder"
BUILDS_ON = {
    "02_best_checkpoint.py": "01_plain.py",
    "03_mixed_precision.py": "02_best_checkpoint.py",
    "04_compile.py": "03_mixed_precision.py",
    "05_data_loading.py": "04_compile.py",
    "06_ddp.py": "05_data_loading.py",
    "07_deepspeed.py": "06_ddp.py",
    "08_fsdp.py": "06_ddp.py",
    "09_early_stopping.py": "05_data_loading.py",
}
SCRIPTS = ["01_plain.py", *BUILDS_ON]
MAX_LINES = 175  # the sharded scripts carry the whole single-device ladder below them
MAX_LESSON = 50  # lines a rung adds or rewrites: DDP's, the longest, is 47
TAG = re.compile(r"# \[(\d\d)\]")  # a rung's tag: `code  # [04]`, `code  # [04] why`, `# [04] comment`
LOSS_LINE = re.compile(r"^step (\d+) loss (\S+)$", re.M)
EPOCH_LINE = re.compile(r"^epoch (\d+): val loss (\S+) acc ([\d.]+),", re.M)
TEST_LINE = re.compile(r"^test \(best epoch (\d+)\): loss (\S+) acc (\S+)$", re.M)
JOB_MARK = "@@@ job "

# Flags that turn the later scripts' techniques off where a comparison needs plain float32.
FP32 = {"03_mixed_precision.py": ["--precision", "32-true"], "04_compile.py": ["--precision", "32-true"],
        "05_data_loading.py": ["--precision", "32-true", "--no-compile"],
        "06_ddp.py": ["--precision", "32-true", "--no-compile", "--num-workers", "0"],
        "07_deepspeed.py": ["--precision", "32-true", "--num-workers", "0"],
        "08_fsdp.py": ["--precision", "32-true", "--no-compile", "--num-workers", "0"],
        "09_early_stopping.py": ["--precision", "32-true", "--no-compile", "--num-workers", "0"]}

pytestmark = pytest.mark.timeout(600)


# --------------------------------------------------------------------------- shape of the ladder

def rung(script: str) -> str:
    return script[:2]


def ancestors(script: str) -> list[str]:
    """The rungs a script is built from, oldest first (01 carries no tag)."""
    chain = []
    while script in BUILDS_ON:
        script = BUILDS_ON[script]
        chain.insert(0, rung(script))
    return chain


def untagged(line: str) -> str:
    """The line's code and comment without its rung tag."""
    return re.sub(r"# \[\d\d\] ", "# ", re.sub(r"  # \[\d\d\]$", "", line))


def source(name: str) -> list[str]:
    return (LADDER / name).read_text().splitlines()


def docstring_end(lines: list[str]) -> int:
    """Number of lines the module docstring spans from the top."""
    return ast.parse("\n".join(lines)).body[0].end_lineno


def lesson(old: list[str], new: list[str], tag: str) -> tuple[tuple[int, int], list[str], list[str]]:
    """((lines removed, lines added), changed lines without `tag`, kept lines whose old tag was replaced).

    The diff compares whole lines, tags included: a line the new script keeps must keep its tag too.
    Every added or rewritten line outside the module docstring (blank lines aside) carries `tag` and
    only it; a line whose code is unchanged but whose tag differs is a retagged line, not a new one.
    """
    body_start = docstring_end(new)
    removed = added = 0
    missing, retagged = [], []
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        removed, added = removed + i2 - i1, added + j2 - j1
        old_code = {untagged(line) for line in old[i1:i2]}
        for j in range(max(j1, body_start), j2):
            if not new[j].strip():
                continue
            if TAG.findall(new[j]) != [tag]:
                missing.append(f"{j + 1}: {new[j]}")
            elif untagged(new[j]) in old_code:
                retagged.append(f"{j + 1}: {new[j]}")
    return (removed, added), missing, retagged


def test_lesson_check_catches_untagged_and_retagged_lines():
    old = ['"""Base."""', "x = 1  # [02]", "y = 2"]
    assert lesson(old, ['"""Next."""', "x = 1  # [02]", "", "y = 3  # [03] why", "# [03] a comment", "z = 4"],
                  "03") == ((2, 5), ["6: z = 4"], [])
    assert lesson(old, ['"""Next."""', "x = 1  # [03]", "y = 2"], "03") == ((2, 2), [], ["2: x = 1  # [03]"])
    assert lesson(old, ['"""Next."""', "x = 1", "y = 2"], "03") == ((2, 2), ["2: x = 1"], [])  # tag dropped
    assert lesson(old, ['"""Next."""', "x = 1  # [02]", "y = 2  # [04]"], "03")[1] == ["3: y = 2  # [04]"]


@pytest.mark.parametrize("script", list(BUILDS_ON))
def test_each_script_is_its_base_plus_its_own_tagged_lines(script):
    base = BUILDS_ON[script]
    new = source(script)
    assert new[0].startswith(f'"""{script}: {base} + '), "the docstring's first line names the script it builds on"
    _, missing, retagged = lesson(source(base), new, rung(script))
    assert not missing, f"lines new in {script} without its tag [{rung(script)}] (or with another too):\n" + \
        "\n".join(missing)
    assert not retagged, f"lines {script} keeps from {base}, retagged:\n" + "\n".join(retagged)
    tags = [tag for line in new for tag in TAG.findall(line)]
    assert set(tags) <= {*ancestors(script), rung(script)}, f"tags of rungs {script} is not built on"


def test_each_lesson_is_short():
    """`diff BASE SCRIPT` shows one technique: a screenful of added or rewritten lines at most."""
    for script, base in BUILDS_ON.items():
        (removed, added), _, _ = lesson(source(base), source(script), rung(script))
        assert added <= MAX_LESSON and removed < added, (script, removed, added)


@pytest.mark.parametrize("script", list(BUILDS_ON))
def test_each_script_builds_on_the_script_it_differs_least_from(script):
    """07 and 08 both build on 06, 09 on 05: diffing 08 against 07 would show DeepSpeed's lines undone too."""
    def diff_size(base: str) -> int:
        removed, added = lesson(source(base), source(script), rung(script))[0]
        return removed + added

    earlier = [name for name in SCRIPTS if name < script]
    assert min(earlier, key=diff_size) == BUILDS_ON[script]


def test_scripts_are_short():
    assert sorted(p.name for p in LADDER.glob("*.py")) == sorted(SCRIPTS)
    for script in SCRIPTS:
        assert len(source(script)) <= MAX_LINES, script
    assert not any(TAG.search(line) for line in source("01_plain.py")), "the base has nothing new"


@pytest.mark.parametrize("script,env,flags,hint", [
    ("06_ddp.py", {}, [], "torchrun --nproc_per_node=2"),
    ("08_fsdp.py", {}, [], "torchrun --nproc_per_node=2"),
    ("07_deepspeed.py", {}, [], "torchrun --nproc_per_node=2"),
    ("07_deepspeed.py", {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}, [], "--precision bf16-mixed"),
])
def test_started_the_wrong_way_a_script_says_how_in_one_line(script, env, flags, hint, monkeypatch, capsys):
    """Without torchrun's variables (06-08), or in float16 on the CPU (07's default): one line, status 2."""
    if "RANK" in env and __import__("torch").cuda.is_available():
        pytest.skip("float16 is refused on the CPU only")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", [str(LADDER / script), "--model", "tiny", *flags])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(LADDER / script), run_name="__main__")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # (stdout may hold DeepSpeed's own import-time note on a CPU)
    assert len(err.splitlines()) == 1 and hint in err, err


# --------------------------------------------------------------------------- running them

BATCH_SIZE = 8
ODD_TRAIN_SIZE = 6 * BATCH_SIZE - 1  # on 2 ranks: 2 whole global batches, 3 if padded to 48


def common_args(imdb_dir, cache_dir) -> list[str]:
    return ["--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir), "--max-length", "64",
            "--batch-size", str(BATCH_SIZE), "--log-every", "1", "--val-size", "15", "--test-size", "31"]


def run_script(path: Path, args: list[str]) -> str:
    """`python path args...` in this process; its stdout. A non-zero exit fails the test."""
    out, argv = io.StringIO(), sys.argv
    sys.argv = [str(path), *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        assert e.code in (None, 0), f"{path.name} exited with {e.code}:\n{out.getvalue()[-3000:]}"
    finally:
        sys.argv = argv
    return out.getvalue()


def printed_losses(output: str) -> dict[int, float]:
    losses = {int(step): float(loss) for step, loss in LOSS_LINE.findall(output)}
    assert losses, f"no 'step N loss X' lines in:\n{output[-3000:]}"
    return losses


def tensorboard_losses(out: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/loss")}


def train_py(args: list[str], out: Path) -> tuple[dict[int, float], dict]:
    """train.py's per-step losses (TensorBoard) and results.json, run in this process."""
    from train import main as train_main
    assert train_main([*args, "--no-progress", "--out", str(out)]) == 0
    return tensorboard_losses(out), json.loads((out / "results.json").read_text())


def assert_same_losses(ladder: dict[int, float], reference: dict[int, float]) -> None:
    """Step by step, to TensorBoard's float32 (train.py stores its float64 mean as float32)."""
    assert sorted(ladder) == sorted(reference)
    for step, loss in ladder.items():
        assert loss == pytest.approx(reference[step], rel=1e-6), f"step {step}"


def assert_same_evaluation(output: str, results: dict) -> None:
    """Validation per epoch and the test on the best epoch, as printed to 4 decimals."""
    epochs = EPOCH_LINE.findall(output)
    assert [(int(e), v_loss, v_acc) for e, v_loss, v_acc in epochs] == [
        (h["epoch"], f"{h['val_loss']:.4f}", f"{h['val_acc']:.4f}") for h in results["history"]]
    (best_epoch, test_loss, test_acc), = TEST_LINE.findall(output)
    assert (int(best_epoch), test_loss, test_acc) == (
        results["best_epoch"], f"{results['test_loss']:.4f}", f"{results['test_acc']:.4f}")


SINGLE = {  # script: (its flags, train.py's flags for the same computation)
    "01_plain.py": ([], []),
    "02_best_checkpoint.py": ([], []),
    # --deterministic: train.py measures no attention precision and keeps autocast's, as Lightning's bf16-mixed
    "03_mixed_precision.py": (["--precision", "bf16-mixed"], ["--amp", "--amp-dtype", "bfloat16", "--deterministic"]),
    "05_data_loading.py": (["--precision", "32-true", "--no-compile", "--num-workers", "1"], []),
}


@pytest.fixture(scope="module")
def train_py_runs(tmp_path_factory):
    """train.py's (losses, results) per command line, each run once for the whole module."""
    runs = {}

    def get(args: list[str]):
        if tuple(args) not in runs:
            runs[tuple(args)] = train_py(args, tmp_path_factory.mktemp("train_py"))
        return runs[tuple(args)]
    return get


@pytest.mark.parametrize("script", list(SINGLE))
def test_single_process_script_prints_train_py_losses(script, imdb_dir, cache_dir, train_py_runs):
    ladder_flags, train_flags = SINGLE[script]
    args = common_args(imdb_dir, cache_dir) + ["--epochs", "1", "--max-steps", "2"]
    output = run_script(LADDER / script, args + ladder_flags)
    reference, results = train_py_runs(args + train_flags)
    assert_same_losses(printed_losses(output), reference)
    assert len(reference) == 2
    if script == "01_plain.py":  # no best checkpoint yet: it tests the last weights, train.py the best
        assert re.search(r"^test: loss \S+ acc \S+$", output, re.M)
        assert EPOCH_LINE.findall(output)[0][1:] == (f"{results['history'][0]['val_loss']:.4f}",
                                                     f"{results['history'][0]['val_acc']:.4f}")
    else:
        assert_same_evaluation(output, results)


def test_early_stopping_stops_where_train_py_stops(imdb_dir, cache_dir, tmp_path):
    """Two whole epochs: reshuffling per epoch, evaluation between them and the stop itself agree."""
    args = common_args(imdb_dir, cache_dir) + ["--epochs", "3", "--train-size", "32",
                                               "--early-stopping-patience", "1", "--min-delta", "1.0"]
    output = run_script(LADDER / "09_early_stopping.py", args + FP32["09_early_stopping.py"])
    reference, results = train_py(args, tmp_path / "train_py")
    assert results["stopped_early"] and results["epochs_run"] == 2
    assert "early stopping: 1 epoch(s) without improvement" in output
    assert len(reference) == 2 * 32 // 8
    assert_same_losses(printed_losses(output), reference)
    assert_same_evaluation(output, results)


@pytest.mark.slow  # two Inductor compiles (train, eval); the second run mostly hits Inductor's cache
def test_compiled_script_prints_train_py_compile_losses(imdb_dir, cache_dir, tmp_path):
    """The reference is train.py --compile with the script's compiled unit, the whole model (on a GPU compiled
    dropout draws other random numbers than eager, and train.py's default, layer by layer, others again)."""
    import torch._dynamo
    args = common_args(imdb_dir, cache_dir) + ["--epochs", "1", "--max-steps", "2", "--val-size", "8",
                                               "--test-size", "8"]
    torch._dynamo.reset()
    try:
        output = run_script(LADDER / "04_compile.py", args + FP32["04_compile.py"])
        reference, results = train_py(args + ["--compile", "--compile-scope", "whole"], tmp_path / "train_py")
    finally:
        torch._dynamo.reset()
    assert_same_losses(printed_losses(output), reference)
    assert_same_evaluation(output, results)


# --------------------------------------------------------------------------- two processes

@pytest.fixture(scope="module")
def distributed_runs(imdb_dir, cache_dir, tmp_path_factory):
    """{job: rank 0's output} of one torchrun launch of two gloo processes; train.py's run folder."""
    out = tmp_path_factory.mktemp("ladder_ddp") / "train_py"
    # A whole epoch of an odd-sized split: a sampler that pads it to a multiple of the ranks would
    # give the scripts one more step than train.py (2 ranks, batch 8: 24 reviews each, 3 steps vs 2).
    args = common_args(imdb_dir, cache_dir) + ["--epochs", "1", "--train-size", str(ODD_TRAIN_SIZE)]
    jobs = [[str(LADDER / name), *args, *FP32[name]] for name in ("06_ddp.py", "08_fsdp.py", "07_deepspeed.py")]
    jobs.append([str(ROOT / "train.py"), *args, "--ddp", "--no-progress", "--out", str(out)])
    argv = [a for job in jobs for a in ("--", *job)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", __file__, *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    sections = proc.stdout.split(JOB_MARK)[1:]
    outputs = {Path(section.split("\n", 1)[0]).name: section for section in sections}
    assert list(outputs) == ["06_ddp.py", "08_fsdp.py", "07_deepspeed.py", "train.py"], proc.stdout[-3000:]
    return outputs, out


def test_ddp_script_prints_train_py_ddp_losses(distributed_runs):
    outputs, out = distributed_runs
    reference = tensorboard_losses(out)
    assert len(reference) == ODD_TRAIN_SIZE // (2 * BATCH_SIZE)  # whole global batches only, as train.py takes
    assert_same_losses(printed_losses(outputs["06_ddp.py"]), reference)
    assert_same_evaluation(outputs["06_ddp.py"], json.loads((out / "results.json").read_text()))


@pytest.mark.parametrize("script", ["07_deepspeed.py", "08_fsdp.py"])
def test_sharded_scripts_follow_ddp(distributed_runs, script):
    """Sharding changes where the state lives, not the maths: the same losses and test as DDP."""
    outputs, _ = distributed_runs
    ddp = printed_losses(outputs["06_ddp.py"])
    sharded = printed_losses(outputs[script])
    assert sorted(sharded) == sorted(ddp)
    for step in ddp:
        assert sharded[step] == pytest.approx(ddp[step], rel=1e-5), f"step {step}"
    assert TEST_LINE.findall(outputs[script]) == TEST_LINE.findall(outputs["06_ddp.py"])


# --------------------------------------------------------------------------- the torchrun driver

def run_jobs(jobs: list[list[str]]) -> int:
    """Run each `script args...` in turn in this torchrun process, as `python script args...` would.

    One launch for every job: starting processes and importing torch, transformers and deepspeed
    costs far more than a two-step run. The first job creates the process group; later calls to
    init_process_group are skipped and destroy_process_group waits for the end (a second group
    cannot rendezvous on torchrun's store under the same name).
    """
    import torch.distributed as dist
    init, destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *a, **k: None if dist.is_initialized() else init(*a, **k)
    dist.destroy_process_group = lambda *a, **k: None
    # DeepSpeed on the CPU would JIT-compile a shared-memory all-reduce op (minutes); gloo suffices.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    rank = int(os.environ.get("RANK", 0))
    try:
        for script, *args in jobs:
            if rank == 0:
                print(JOB_MARK + script, flush=True)
            sys.path[0], sys.argv = str(Path(script).parent), [script, *args]  # as `python script args` sets them
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                if e.code not in (None, 0):
                    return e.code
            sys.stdout.flush()
    finally:
        if dist.is_initialized():
            destroy()
    return 0


if __name__ == "__main__":
    jobs = [[]]  # torchrun drops the first "--": jobs are separated by "--", not introduced by it
    for arg in sys.argv[1:]:
        if arg == "--":
            jobs.append([])
        else:
            jobs[-1].append(arg)
    status = run_jobs([job for job in jobs if job])
    sys.path.insert(0, str(ROOT))
    from fastpt.cli.shell import exit_process
    exit_process(status)  # os._exit: the scripts' models still hold the group, whose gloo threads can abort exit
