"""Every bad input: exit code 2, one line on stderr naming the problem, the run folder untouched.

One table row per case: the flags, an optional setup (files to create, a monkeypatch to
simulate hardware this machine lacks), and the words the error line must contain. Every row
checks the run folder before and after: a folder that did not exist is still absent, a
folder that held a run holds exactly the same files, sizes and times.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import tar_folder, write_imdb

from fastpt.cli.shell import EXIT_BAD_INPUT
from fastpt.cluster import distributed
from train import main


class _RunsCode:
    """Unpickling this creates a file: proof that code from a model folder ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, imdb_dir, cache_dir) -> dict:
    """Broken datasets, incomplete model folders and a finished run with a checkpoint."""
    from fastpt.inputs.models import load_model, load_tokenizer

    root = tmp_path_factory.mktemp("bad-inputs")
    made = {"empty": root / "empty"}
    made["empty"].mkdir()

    made["garbage"] = root / "garbage"
    made["garbage"].mkdir()
    (made["garbage"] / "aclImdb_v1.tar.gz").write_bytes(b"this is not a gzip file\n" * 100)

    made["truncated"] = root / "truncated"
    made["truncated"].mkdir()
    whole = (imdb_dir / "aclImdb_v1.tar.gz").read_bytes()
    (made["truncated"] / "aclImdb_v1.tar.gz").write_bytes(whole[: len(whole) // 2])

    made["no_test_folders"] = root / "no-test"
    made["no_test_folders"].mkdir()
    source = write_imdb(root / "partial-src", per_folder=4)
    shutil.rmtree(source / "test")
    tar_folder(source, made["no_test_folders"] / "aclImdb_v1.tar.gz")
    with tarfile.open(made["no_test_folders"] / "aclImdb_v1.tar.gz") as tar:
        assert not any("/test/" in name for name in tar.getnames())

    model, tokenizer = load_model("tiny", False), load_tokenizer("tiny")  # also warms up imports
    made["model_no_weights"] = root / "model-no-weights"
    model.config.save_pretrained(made["model_no_weights"])
    tokenizer.save_pretrained(made["model_no_weights"])
    made["model_no_tokenizer"] = root / "model-no-tokenizer"
    model.save_pretrained(made["model_no_tokenizer"])
    made["model_truncated"] = root / "model-truncated"  # a download cut short
    model.save_pretrained(made["model_truncated"])
    tokenizer.save_pretrained(made["model_truncated"])
    weights = made["model_truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    made["model_pickle"] = root / "model-pickle"  # a crafted pytorch_model.bin: its unpickling runs code
    model.config.save_pretrained(made["model_pickle"])
    tokenizer.save_pretrained(made["model_pickle"])
    made["pickle_marker"] = root / "pickle-ran"
    torch.save({"weight": _RunsCode(made["pickle_marker"])}, made["model_pickle"] / "pytorch_model.bin")

    made["finished"] = root / "finished"
    assert main(["--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir), "--max-length", "64",
                 "--batch-size", "8", "--train-size", "16", "--epochs", "1", "--save-every", "1", "--no-progress",
                 "--out", str(made["finished"])]) == 0
    made["partial"] = root / "partial"  # killed before its first checkpoint: config.json and tb/ only
    (made["partial"] / "tb").mkdir(parents=True)
    shutil.copy(made["finished"] / "config.json", made["partial"] / "config.json")
    made["a_file"] = root / "a-file"
    made["a_file"].write_text("not a folder\n")
    made["read_only"] = root / "read-only"
    (made["read_only"] / "earlier-run").mkdir(parents=True)
    made["not_json"] = root / "ds.json"
    made["not_json"].write_text("{ zero_optimization: stage 2 }\n")
    made["json_array"] = root / "ds-array.json"
    made["json_array"].write_text('[{"zero_optimization": {"stage": 2}}]\n')
    made["locked"] = root / "locked"
    made["locked"].mkdir()
    made["truncated_ckpt"] = root / "truncated-ckpt"
    (made["truncated_ckpt"] / "checkpoints").mkdir(parents=True)
    last = (made["finished"] / "checkpoints" / "last.pt").read_bytes()
    (made["truncated_ckpt"] / "checkpoints" / "last.pt").write_bytes(last[: len(last) // 3])
    return made


def _no_deepspeed(monkeypatch, inputs):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # importlib.util.find_spec then finds nothing


class _AcceleratorWithoutFloat16:
    """DeepSpeed's CPU accelerator where oneDNN has no float16 (no AVX512-FP16 or AVX-NE-CONVERT), on any CPU."""

    def is_fp16_supported(self):
        return False

    def is_bf16_supported(self):
        return True

    def device_name(self):
        return "cpu"


def _deepspeed_without_float16(monkeypatch, inputs):
    import deepspeed.accelerator
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", _AcceleratorWithoutFloat16)


def _pre_ampere_gpu(monkeypatch, inputs):
    """A CUDA device without bfloat16 (e.g. a V100), which this CPU machine cannot provide."""
    monkeypatch.setattr(distributed, "init", lambda device, needs_group=False, **_:
                        distributed.DistInfo(0, 0, 1, torch.device("cuda", 0)))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100-SXM2-16GB")


def _python_without_dynamo(monkeypatch, inputs):
    import torch._dynamo
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)


def _read_only_folder(monkeypatch, inputs):
    """{read_only} on a read-only file system. The tests run as root, where chmod stops no write,
    so the check is made to fail through os.access, as it would on a read-only mount."""
    read_only, real_access = inputs["read_only"], os.access

    def access(path, mode, **kwargs):
        inside = Path(path).resolve() == read_only or read_only in Path(path).resolve().parents
        return False if inside and mode & os.W_OK else real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", access)


_held_locks = []


def _another_run_holds_the_folder(monkeypatch, inputs):
    """{locked} claimed by another run: its lock file held with flock, as a running fastpt holds it."""
    fd = os.open(inputs["locked"] / ".lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"4242\n")
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held_locks.append(fd)


NO_OUT = "(no --out)"
FINISHED = "{finished}"
LAST_PT = "{finished}/checkpoints/last.pt"

# (case id, extra flags, setup, words the one error line must contain, run folder)
# The run folder is "{out}" (a fresh path under tmp_path) unless the case is about another one.
CASES = [
    ("unknown flag", ["--frobnicate"], None, "unrecognized arguments: --frobnicate", "{out}"),
    ("two strategies", ["--ddp", "--fsdp"], None, "choose one strategy, not --ddp and --fsdp", "{out}"),
    ("deepspeed config without deepspeed", ["--deepspeed-config", "ds.json"], None,
     "--deepspeed-config needs --deepspeed", "{out}"),
    ("min delta without early stopping", ["--min-delta", "0.1"], None, "--min-delta needs --early-stopping-patience",
     "{out}"),
    ("amp dtype without amp", ["--amp-dtype", "bfloat16"], None, "--amp-dtype needs --amp", "{out}"),
    ("zero stage without deepspeed", ["--ddp", "--zero-stage", "3"], None, "--zero-stage needs --deepspeed", "{out}"),
    ("compile mode without compile", ["--compile-mode", "max-autotune"], None, "--compile-mode needs --compile",
     "{out}"),
    ("compile scope without compile", ["--compile-scope", "whole"], None, "--compile-scope needs --compile", "{out}"),
    ("whole-model compile under fsdp", ["--fsdp", "--compile", "--compile-scope", "whole"], None,
     "--compile-scope whole is not supported with --fsdp", "{out}"),
    ("deepspeed not installed", ["--deepspeed"], _no_deepspeed, "--deepspeed needs the deepspeed package", "{out}"),
    ("bfloat16 on a GPU without it", ["--amp", "--amp-dtype", "bfloat16"], _pre_ampere_gpu,
     "--amp-dtype bfloat16 is not supported on Tesla V100", "{out}"),
    ("compile on an unsupported Python", ["--compile"], _python_without_dynamo, "--compile is not supported", "{out}"),
    ("cuda without a GPU", ["--device", "cuda"], None, "no CUDA device is available", "{out}"),
    ("zero batch size", ["--batch-size", "0"], None, "--batch-size must be positive, got 0", "{out}"),
    ("thousands of loader workers", ["--num-workers", "100000"], None,
     "--num-workers 100000 is more than this machine can use: at most", "{out}"),
    ("negative max length", ["--max-length", "-8"], None, "--max-length must be positive, got -8", "{out}"),
    ("max length over 512", ["--max-length", "1024"], None, "exceeds the 512 positions", "{out}"),
    ("zero epochs", ["--epochs", "0"], None, "--epochs must be positive, got 0", "{out}"),
    ("zero train size", ["--train-size", "0"], None, "--train-size must be positive, got 0", "{out}"),
    ("zero save every", ["--save-every", "0"], None, "--save-every must be positive, got 0", "{out}"),
    ("negative save every minutes", ["--save-every-minutes", "-1"], None,
     "--save-every-minutes must be 0 (off) or positive, got -1.0", "{out}"),
    ("negative grad accum", ["--grad-accum", "-1"], None, "--grad-accum must be positive, got -1", "{out}"),
    ("zero learning rate", ["--lr", "0"], None, "--lr must be positive", "{out}"),
    ("not a number", ["--batch-size", "eight"], None, "invalid int value: 'eight'", "{out}"),
    ("too few examples for a batch", ["--train-size", "4"], None, "make no full batch of 8", "{out}"),
    ("missing dataset", ["--data-dir", "{empty}"], None, "no IMDB data in", "{out}"),
    ("corrupt archive", ["--data-dir", "{garbage}"], None, "corrupt or incomplete archive", "{out}"),
    ("truncated archive", ["--data-dir", "{truncated}"], None, "corrupt or incomplete archive", "{out}"),
    ("archive without the expected folders", ["--data-dir", "{no_test_folders}"], None,
     "has no aclImdb/test/pos/*.txt reviews", "{out}"),
    ("model folder without weights", ["--model", "{model_no_weights}"], None, "has no weights", "{out}"),
    ("model folder without tokenizer", ["--model", "{model_no_tokenizer}"], None, "has no tokenizer", "{out}"),
    ("truncated model weights", ["--model", "{model_truncated}"], None,
     "model.safetensors is damaged (incomplete metadata, file not fully covered)", "{out}"),
    ("model weights that run code", ["--model", "{model_pickle}"], None,
     "pytorch_model.bin holds objects other than tensors", "{out}"),
    ("out folder holds another run", [], None, "holds a finished run; pass --overwrite", FINISHED),
    ("resume with another max length", ["--resume", "auto", "--max-length", "32"], None,
     "--max-length was 64, now 32", FINISHED),
    ("resume without a flag it had", ["--resume", "auto"], None, "--train-size was 16, now unset", FINISHED),
    ("resume with another model", ["--resume", "auto", "--model", "{model_no_weights}"], None,
     "--model was 'tiny', now", FINISHED),
    ("resume with another strategy", ["--resume", "auto", "--train-size", "16", "--ddp"], None,
     "--strategy was 'single', now 'ddp'", FINISHED),
    ("resume auto over another run without checkpoint", ["--resume", "auto", "--train-size", "16", "--lr", "1e-3"],
     None, "cannot continue the run in", "{partial}"),
    ("resume auto without --out", ["--resume", "auto", NO_OUT], None, "--resume auto needs --out", None),
    ("resume a missing checkpoint", ["--resume", "{out}/checkpoints/last.pt", NO_OUT], None,
     "no such checkpoint file", "{out}"),
    ("resume into another folder", ["--resume", LAST_PT], None, "continues in its own run folder", "{out}"),
    ("resume a truncated checkpoint", ["--resume", "{truncated_ckpt}/checkpoints/last.pt", NO_OUT], None,
     "cannot read checkpoint", "{truncated_ckpt}"),
    # Floats that parse but mean nothing.
    ("min delta nan", ["--early-stopping-patience", "1", "--min-delta", "nan"], None,
     "--min-delta must be a finite number, got nan", "{out}"),
    ("min delta inf", ["--early-stopping-patience", "1", "--min-delta", "inf"], None,
     "--min-delta must be a finite number, got inf", "{out}"),
    ("negative min delta", ["--early-stopping-patience", "1", "--min-delta", "-0.1"], None,
     "--min-delta must be >= 0", "{out}"),
    ("max grad norm nan", ["--max-grad-norm", "nan"], None, "--max-grad-norm must be a finite number", "{out}"),
    ("max grad norm inf", ["--max-grad-norm", "inf"], None, "--max-grad-norm must be a finite number", "{out}"),
    ("learning rate inf", ["--lr", "inf"], None, "--lr must be a finite number, got inf", "{out}"),
    ("learning rate nan", ["--lr", "nan"], None, "--lr must be a finite number, got nan", "{out}"),
    # Output places that cannot be written.
    ("out names a file", ["--out", "{a_file}"], None, "is a file, not a folder", "{a_file}"),
    ("out inside a file", ["--out", "{a_file}/run"], None, "is a file, not a folder", "{a_file}"),
    ("out new on a read-only file system", ["--out", "{read_only}/run"], _read_only_folder, "cannot write in",
     "{read_only}"),
    ("out existing on a read-only file system", ["--out", "{read_only}/earlier-run"], _read_only_folder,
     "cannot write in", "{read_only}"),
    ("default out in a read-only folder", [NO_OUT], _read_only_folder, "cannot write in", "{read_only}"),
    ("cache dir names a file", ["--cache-dir", "{a_file}"], None, "--cache-dir", "{out}"),
    ("cache dir on a read-only file system", ["--cache-dir", "{read_only}/cache"], _read_only_folder,
     "--cache-dir", "{out}"),
    ("out in use by another run", ["--out", "{locked}"], _another_run_holds_the_folder,
     "is in use by another run (process 4242)", "{locked}"),
    # DeepSpeed: precision its accelerator lacks, a config that cannot be read.
    ("deepspeed float16 on the CPU", ["--deepspeed", "--amp", "--device", "cpu"], _deepspeed_without_float16,
     "DeepSpeed has no float16 on this device", "{out}"),
    ("deepspeed config missing", ["--deepspeed", "--deepspeed-config", "{empty}/ds.json", NO_OUT], None,
     "--deepspeed-config", None),
    ("deepspeed config not JSON", ["--deepspeed", "--deepspeed-config", "{not_json}"], None,
     "--deepspeed-config", "{out}"),
    ("deepspeed config not an object", ["--deepspeed", "--deepspeed-config", "{json_array}"], None,
     "holds an array, not a JSON object of DeepSpeed settings", "{out}"),
]


def snapshot(folder: Path | None):
    """Every file under folder with its size and modification time; None if it does not exist."""
    if folder is None or not folder.exists():
        return None
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def _fill(value, places: dict):
    return value.format(**places) if isinstance(value, str) else value


@pytest.mark.parametrize("flags, setup, expected, run_folder", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(flags, setup, expected, run_folder, inputs, tiny_args, tmp_path, monkeypatch, capfd, request):
    places = {**{k: str(v) for k, v in inputs.items()}, "out": str(tmp_path / "run")}
    out = Path(_fill(run_folder, places)) if run_folder else None
    args = tiny_args(out=out or tmp_path / "run") + [_fill(f, places) for f in flags if f != NO_OUT]
    if NO_OUT in flags:
        i = args.index("--out")
        del args[i:i + 2]
    if setup:
        setup(monkeypatch, inputs)
    # Where a run without --out would create runs/<time>: tmp_path, or the read-only folder.
    monkeypatch.chdir(inputs["read_only"] if "default out" in request.node.name else tmp_path)
    before = snapshot(out)
    capfd.readouterr()

    assert main(args) == EXIT_BAD_INPUT

    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: ") and expected in err[0], err[0]
    assert snapshot(out) == before  # not created, not cleared, not written
    assert not (tmp_path / "runs").exists()  # no default run folder either
    assert not any(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))  # one-rank set-up undone


def test_a_crafted_model_pickle_never_runs(inputs, tiny_args, tmp_path):
    """The crafted pytorch_model.bin above is refused without its code running (no marker file)."""
    assert main(tiny_args("--model", str(inputs["model_pickle"]), out=tmp_path / "run")) == EXIT_BAD_INPUT
    assert not inputs["pickle_marker"].exists()
    torch.load(inputs["model_pickle"] / "pytorch_model.bin", weights_only=False)  # a full unpickling runs it
    assert inputs["pickle_marker"].exists()
    inputs["pickle_marker"].unlink()
