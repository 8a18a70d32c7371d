"""The IMDB Large Movie Review dataset and the article's exact 35k/5k/10k split.

Accepted sources, looked for in this order inside `--data-dir` (or `$FASTPT_DATA_DIR`):
an extracted `aclImdb/` folder, the official `aclImdb_v1.tar.gz`, or the labelled-only
`aclImdb_v1_labelled.tar.gz`. `--data-dir` may also name the folder or tarball itself.
Without either, the official tarball is downloaded into `./data`.

The split is the article's, bit for bit (checked against the fingerprints in the tests):
1. reviews are concatenated as test/pos, test/neg, train/pos, train/neg, each folder in
   Python `sorted()` order of the file name; label pos = 1, neg = 0;
2. the article's first shuffle (`np.random.seed(0)` + a pandas reindex) is a no-op there,
   because every row carries index 0, so it is left out;
3. the effective shuffle, pandas `sample(frac=1, random_state=1)`, takes rows in the order
   `numpy.random.RandomState(1).permutation(n)`;
4. the first 70% are train, the next 10% validation, the last 20% test (35,000 / 5,000 / 10,000).
"""

import contextlib
import hashlib
import os
import re
import shutil
import tarfile
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastpt.errors import DataError


URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
TARBALLS = ("aclImdb_v1.tar.gz", "aclImdb_v1_labelled.tar.gz")
FOLDERS = ("test/pos", "test/neg", "train/pos", "train/neg")  # the article's concatenation order
SPLIT_FRACTIONS = (0.7, 0.1)  # train, validation; the rest is test
FULL_SIZE = 50_000  # labelled reviews in IMDB v1: 25,000 in train/, 25,000 in test/
# The article's split, fingerprinted (shared/data/README.md): the sha256 of each split's review names
# ("train/pos/11122_10.txt", ...) in order, joined with "\n"; its first 16 hex digits.
ARTICLE_SPLIT_SHA256 = {"train": "f1dc0bb04ab74e0d", "validation": "e8b9e7c62c0aeda4", "test": "a4937188a6b37789"}
_MEMBER = re.compile(r"(?:^|/)aclImdb/(train|test)/(pos|neg)/([^/]+\.txt)$")


@dataclass(frozen=True)
class Reviews:
    keys: list[str]  # "<train|test>/<pos|neg>/<file name>", the article's order
    texts: list[str]
    labels: np.ndarray  # int64, 1 = positive


def find_source(data_dir: str | None) -> Path:
    """Where the reviews are: an aclImdb/ folder or a tarball. Downloads only without --data-dir."""
    explicit = data_dir or os.environ.get("FASTPT_DATA_DIR")
    root = Path(explicit or "data")
    for path in (root / "aclImdb", root, *(root / name for name in TARBALLS)):
        if path.is_file() or (path / "train" / "pos").is_dir():
            return path
    if explicit:
        raise DataError(f"no IMDB data in {root}: expected aclImdb/, {TARBALLS[0]} or {TARBALLS[1]} there")
    return download(root / TARBALLS[0])


def download(target: Path) -> Path:
    """Fetch the official tarball with a progress bar; fail with advice when offline."""
    from tqdm.auto import tqdm

    made = [p for p in (target.parent, *target.parent.parents) if not p.exists()]  # removed again on failure
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    try:
        with urllib.request.urlopen(URL, timeout=30) as response, open(partial, "wb") as f:
            total = int(response.headers.get("Content-Length", 0)) or None
            with tqdm.wrapattr(f, "write", total=total, desc=f"downloading {target.name}") as counted:
                shutil.copyfileobj(response, counted, 1 << 20)
    except OSError as e:
        partial.unlink(missing_ok=True)
        for folder in made:  # deepest first: a failed download leaves no empty ./data behind
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise DataError(f"could not download {URL} ({e.__class__.__name__}: {e}); if this machine is offline, pass "
                        f"--data-dir DIR (or set FASTPT_DATA_DIR) pointing at a local {TARBALLS[0]} or aclImdb/ "
                        f"folder") from None
    partial.rename(target)
    return target


def read_reviews(source: Path) -> Reviews:
    """All labelled reviews from a folder or tarball, in the article's order."""
    found: dict[str, str] = {}
    try:
        if source.is_dir():
            for folder in FOLDERS:
                for path in (source / folder).glob("*.txt"):
                    found[f"{folder}/{path.name}"] = path.read_text(encoding="utf-8")
        else:
            with tarfile.open(source, "r:*") as archive:
                for member in archive:
                    match = _MEMBER.search(member.name) if member.isfile() else None
                    if match:
                        found["/".join(match.groups())] = archive.extractfile(member).read().decode("utf-8")
    except (tarfile.TarError, EOFError, zlib.error, OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {source}: {e.__class__.__name__}: {e} (corrupt or incomplete archive?)") from None
    keys = []
    for folder in FOLDERS:
        in_folder = sorted(k for k in found if k.startswith(folder + "/"))  # one prefix: sorted by file name
        if not in_folder:
            raise DataError(f"{source} has no aclImdb/{folder}/*.txt reviews: not an IMDB v1 dataset")
        keys += in_folder
    labels = np.array([1 if k.split("/")[1] == "pos" else 0 for k in keys], dtype=np.int64)
    return Reviews(keys=keys, texts=[found[k] for k in keys], labels=labels)


def differs_from_article(split_keys: dict[str, list[str]]) -> str | None:
    """None if these splits (review names, in order) are the article's, else what the data is instead.

    Any set of reviews in the aclImdb layout is read and split 70/10/20, so a partly extracted or
    edited folder trains without complaint; only the fingerprints tell it from the article's data.
    """
    if all(hashlib.sha256("\n".join(split_keys[name]).encode()).hexdigest().startswith(digest)
           for name, digest in ARTICLE_SPLIT_SHA256.items()):
        return None
    keys = [key for split in split_keys.values() for key in split]
    if len(keys) == FULL_SIZE:
        return f"{FULL_SIZE:,} reviews, but not IMDB v1's (the split's fingerprints differ from the article's)"
    positive = sum(key.split("/")[1] == "pos" for key in keys) / len(keys)
    return (f"{len(keys):,} reviews ({positive:.0%} positive), not IMDB's {FULL_SIZE:,}: they are split "
            f"70/10/20 in proportion, not into the article's 35,000/5,000/10,000")


def split_indices(n: int) -> dict[str, np.ndarray]:
    """The article's shuffle and 70/10/20 cut of n rows (35k/5k/10k for the full 50k)."""
    n_train, n_val = (round(n * fraction) for fraction in SPLIT_FRACTIONS)
    cuts = np.split(np.random.RandomState(1).permutation(n), [n_train, n_train + n_val])
    return dict(zip(("train", "validation", "test"), cuts))
