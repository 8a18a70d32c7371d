"""Shared fixtures: a tiny made-up aclImdb dataset, an isolated cache, offline Hugging Face."""

from __future__ import annotations

import os
import random
import re
import sys
import tarfile
import time
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POSITIVE = "great wonderful superb moving brilliant delightful charming excellent loved".split()
NEGATIVE = "awful boring terrible dull dreadful clumsy tedious bad hated".split()
NEUTRAL = "the film movie plot actor scene story director music camera and of a it".split()


def make_review(rng: random.Random, positive: bool) -> str:
    """A made-up review whose sentiment words give its label away; lengths vary 8-60 words."""
    words = [rng.choice(NEUTRAL) for _ in range(rng.randint(8, 60))]
    for _ in range(rng.randint(2, 5)):
        words.insert(rng.randrange(len(words)), rng.choice(POSITIVE if positive else NEGATIVE))
    return " ".join(words) + ".<br /><br />" + rng.choice(NEUTRAL)


def write_imdb(root: Path, per_folder: int = 40, seed: int = 0) -> Path:
    """An extracted aclImdb/ folder with `per_folder` reviews in each of the four folders."""
    rng = random.Random(seed)
    for split in ("train", "test"):
        for sentiment in ("pos", "neg"):
            folder = root / "aclImdb" / split / sentiment
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_folder):
                rating = rng.choice([7, 8, 9, 10] if sentiment == "pos" else [1, 2, 3, 4])
                (folder / f"{i}_{rating}.txt").write_text(make_review(rng, sentiment == "pos"), encoding="utf-8")
    return root / "aclImdb"


def tar_folder(folder: Path, target: Path) -> Path:
    with tarfile.open(target, "w:gz") as tar:
        tar.add(folder, arcname="aclImdb")
    return target


def fastpt_frames(output: str) -> list[str]:
    """The traceback frames in fastpt's own code (fastpt/, train.py) found in `output`.

    Frames, not the text "fastpt/": the checkout is often a folder named fastpt, and torchrun's
    failure summary names the worker's script by its path."""
    frames = (Path(f).resolve() for f in re.findall(r'File "([^"]+)", line \d+', output))
    return [str(f) for f in frames if f.is_relative_to(ROOT / "fastpt") or f == ROOT / "train.py"]


@pytest.fixture(autouse=True)
def python_signal_handlers(request):
    """Each test starts with Python's own SIGINT / SIGTERM handlers and leaves them so. A test that
    changed them (a library's worker set-up, a run that ended in an odd state) would otherwise leak
    the change into every later test; this one is named on stderr, and the handlers are put back."""
    import signal

    own = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    for sig, handler in own.items():
        signal.signal(sig, handler)
    yield
    changed = [sig.name for sig, handler in own.items() if signal.getsignal(sig) is not handler]
    if changed:
        print(f"\nnote: {request.node.nodeid} left {', '.join(changed)} handled otherwise; put back",
              file=sys.__stderr__, flush=True)
        for sig, handler in own.items():
            signal.signal(sig, handler)


@pytest.fixture
def one_thread():
    """One thread, as the tests' subprocesses use, and the global switches a --deterministic run turns on
    put back. A module that compares in-process runs with subprocess ones uses it for every test:
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def wait_for(condition, what: str, timeout: float, every: float = 0.25):
    """Poll `condition()` until it returns something true, and return that; after `timeout` seconds fail
    the test naming `what`. The one way the tests wait for another process (a SLURM job, a launcher)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def wait_all(procs: list, timeout: float) -> list[int]:
    """Every process's return code, all of them within one deadline (not `timeout` each)."""
    deadline = time.monotonic() + timeout
    return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]


@pytest.fixture(scope="session")
def imdb_dir(tmp_path_factory) -> Path:
    """A data dir holding a tiny aclImdb_v1.tar.gz (160 reviews: 112 train, 16 val, 32 test)."""
    root = tmp_path_factory.mktemp("imdb")
    folder = write_imdb(root / "src")
    data = root / "data"
    data.mkdir()
    tar_folder(folder, data / "aclImdb_v1.tar.gz")
    return data


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def tiny_args(imdb_dir, cache_dir, tmp_path):
    """Command-line flags for a fast run of the tiny model on the tiny data."""
    def args(*extra, out=None):
        return ["--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache_dir),
                "--max-length", "64", "--batch-size", "8", "--epochs", "2", "--log-every", "2",
                "--no-progress", "--out", str(out or tmp_path / "run"), *extra]
    return args


@pytest.fixture
def own_args(cache_dir, tmp_path):
    """Command-line flags for a fast run of the tiny model on your own table (`--data`), one epoch."""
    def args(data, *extra, out=None):
        return ["--model", "tiny", "--data", str(data), "--cache-dir", str(cache_dir), "--max-length", "24",
                "--batch-size", "8", "--epochs", "1", "--lr", "2e-3", "--log-every", "5", "--no-progress",
                "--no-tensorboard", "--out", str(out or tmp_path / "run"), *extra]
    return args


# ---------------------------------------------------------------------------- test order
# The suite must not depend on its order (a test leaving state that the next one needs, or that
# breaks it). `--test-order reverse` runs the files, and the tests in each, backwards;
# `--test-order shuffle --test-order-seed N` in a seeded random order. Both are run before a release.

def pytest_addoption(parser):
    parser.addoption("--test-order", choices=("file", "reverse", "shuffle"), default="file",
                     help="run the collected tests in file order (default), reversed, or shuffled")
    parser.addoption("--test-order-seed", type=int, default=0, help="the seed of --test-order shuffle")


def pytest_collection_modifyitems(config, items):
    order = config.getoption("--test-order")
    if order == "reverse":
        items.reverse()
    elif order == "shuffle":
        random.Random(config.getoption("--test-order-seed")).shuffle(items)


def flip_labels(path: Path) -> None:
    """What another user with write access could do to a token cache: every label flipped, written in place."""
    import shutil

    import datasets

    loaded = datasets.load_from_disk(str(path))
    flipped = datasets.DatasetDict({name: split.map(lambda row: {"label": 1 - row["label"]}, keep_in_memory=True)
                                    for name, split in loaded.items()})
    staging = path.parent / "staging"
    flipped.save_to_disk(str(staging))
    for file in staging.rglob("*.arrow"):
        shutil.copyfile(file, path / file.relative_to(staging))
    shutil.rmtree(staging)
