"""The token cache: IMDB read, split and tokenised once, then loaded in a second.

The article's split is tokenised at `CACHE_MAX_LENGTH` (512) and saved as Arrow files with
`datasets`, under a key made of the data's content and the tokenizer's vocabulary, so any
run with the same data and tokenizer finds it, and a shorter `--max-length` is cut from it on
load (`truncate`: equal to tokenising at that length, tested). Building is atomic (a temporary
folder renamed into place) and takes turns on a lock file, so concurrent runs build it once.
Under torchrun each node's first process builds or finds its own copy (`prepare_splits`):
nodes need not share a disk.

A cache folder may be shared (one FASTPT_CACHE_DIR for a team), so it is not trusted blindly:
- its key names the data, but nothing on load checks the files against it, so the build records
  the SHA-256 of every file it wrote (`fastpt_digest.json`) and every load recomputes them
  (`verify`): a cache changed afterwards (labels rewritten, say) is refused with one line, not
  trained on. Hashing is cheap next to loading: the 50,000 reviews' 54 MB in 0.14 s, of a 2.9 s
  load (scripts/cache_digest.py, 2 shared CPU cores).
  What it cannot stop is someone able to write the folder who also rewrites the digest:
  keep a shared cache writable only by the people whose builds you would train on.
- its folders follow the umask, as run files do (not mkdtemp's 0700), so teammates can read
  them; a cache they cannot read, or a full disk, is one line naming the folder (and its owner).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pwd
import secrets
import shutil
import stat
from pathlib import Path
from typing import Optional

import numpy as np

from fastpt.inputs import imdb
from fastpt.inputs.data import TokenizedSplit
from fastpt.machinery.errors import DataError, DiskFull


CACHE_VERSION = 3  # 3: every cache folder carries its digest


CACHE_MAX_LENGTH = 512  # the longest --max-length: one cache serves every shorter one


FINGERPRINT_BYTES = 4 << 20


SPLITS = ("train", "validation", "test")


DIGEST = "fastpt_digest.json"  # the SHA-256 of every other file of a cache folder, written when it is built


def _source_fingerprint(source: Path) -> str:
    """Identity of the data by content, not path: the same tarball or folder anywhere shares one cache.

    A tarball: its size and the SHA-256 of its first 4 MiB (gzip headers and the first thousands
    of reviews; a different or truncated file differs there or in size). A folder: every review's
    name and size.
    """
    h = hashlib.sha256()
    if source.is_file():
        h.update(f"file:{source.stat().st_size}:".encode())
        with open(source, "rb") as f:
            h.update(f.read(FINGERPRINT_BYTES))
    else:
        for folder in imdb.FOLDERS:
            d = source / folder
            for name in sorted(os.listdir(d)) if d.is_dir() else []:
                h.update(f"{folder}/{name}:{(d / name).stat().st_size}\n".encode())
    return h.hexdigest()


def _tokenizer_fingerprint(tokenizer) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    lower = getattr(tokenizer, "do_lower_case", "")
    return hashlib.sha256(f"{type(tokenizer).__name__}:{lower}:{vocab}".encode()).hexdigest()


def cache_key(source: Path, tokenizer) -> str:
    """One cache per (data, tokenizer): built at CACHE_MAX_LENGTH, cut to any shorter --max-length on load."""
    parts = {
        "version": CACHE_VERSION,
        "source": _source_fingerprint(source),
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "max_length": CACHE_MAX_LENGTH,
        "split": imdb.SPLIT_FRACTIONS,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def default_cache_dir() -> Path:
    return Path(os.environ.get("FASTPT_CACHE_DIR") or Path.home() / ".cache" / "fastpt")


def cache_root(cache_dir: Optional[str]) -> Path:
    """--cache-dir, else the default: where the token cache (and the Inductor cache) live."""
    return Path(cache_dir) if cache_dir else default_cache_dir()


def cache_setting(cache_dir: Optional[str]) -> str:
    """The setting an error about the cache folder names: FASTPT_CACHE_DIR where the folder is its value
    (the run's config holds the resolved folder either way), else --cache-dir."""
    env = os.environ.get("FASTPT_CACHE_DIR")
    if env and (not cache_dir or Path(cache_dir).resolve() == Path(env).resolve()):
        return "FASTPT_CACHE_DIR"
    return "--cache-dir"


def build_cache(source: Path, tokenizer, target: Path) -> None:
    """Read, split and tokenise all reviews at CACHE_MAX_LENGTH; publish the splits under target atomically.

    The splits are written to a temporary folder and renamed into place, so a reader never sees
    a half-written cache. If another process published the same cache first (same key, same
    content), its copy is kept and this one dropped.
    """
    import datasets

    reviews = imdb.read_reviews(source)
    texts = [t.replace("<br />", " ") for t in reviews.texts]
    tmp = new_temporary(target)
    try:
        splits = {}
        for name, idx in imdb.split_indices(len(texts)).items():
            table = datasets.Dataset.from_dict({
                "key": [reviews.keys[i] for i in idx],
                "text": [texts[i] for i in idx],
                "label": reviews.labels[idx].tolist(),
            })
            splits[name] = table.map(
                lambda batch: tokenizer(batch["text"], truncation=True, max_length=CACHE_MAX_LENGTH),
                batched=True, batch_size=1000, remove_columns=["text"], desc=f"tokenising {name}",
                load_from_cache_file=False, keep_in_memory=True,
            ).select_columns(["key", "input_ids", "label"])
        datasets.DatasetDict(splits).save_to_disk(str(tmp))
        publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def new_temporary(target: Path) -> Path:
    """An empty folder beside target to build in, with the permissions the umask gives.

    Not `tempfile.mkdtemp`: its mode 0700 would survive the rename, and teammates sharing the
    cache folder could not read the cache (run_folder's files follow the umask the same way).
    """
    while True:
        tmp = target.with_name(f".tmp-{target.name}-{secrets.token_hex(4)}")
        try:
            tmp.mkdir(mode=0o777)
            return tmp
        except FileExistsError:
            continue


def publish(tmp: Path, target: Path) -> None:
    """Record the digest of everything built in tmp, then rename it to target in one step.

    If another process published the same cache first (same key, same content), its copy is kept.
    """
    (tmp / DIGEST).write_text(json.dumps({"sha256": _file_digests(tmp)}, indent=1))
    try:
        os.rename(tmp, target)
    except OSError:
        if not _is_complete(target):  # not another build's finished copy: a real failure
            raise


def _file_digests(folder: Path) -> dict[str, str]:
    """{path inside folder: SHA-256 of its bytes} for every file but the digest file itself."""
    digests = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and name != DIGEST:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            digests[name] = h.hexdigest()
    return digests


def verify(path: Path) -> None:
    """DataError unless every file of the cache is byte for byte what its build recorded.

    A changed, added or removed file, or a changed digest file, is refused: nothing trains on it.
    """
    try:
        recorded = json.loads((path / DIGEST).read_text())["sha256"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        recorded = None
    found = _file_digests(path)
    if recorded == found:
        return
    if isinstance(recorded, dict):
        changed = sorted(set(recorded) ^ set(found) | {n for n in found if recorded.get(n) != found[n]})
        what = f"{changed[0]}{f' and {len(changed) - 1} more' if len(changed) > 1 else ''} differ from its digest"
    else:
        what = f"its digest file {DIGEST} is missing or unreadable"
    raise DataError(f"refused the token cache {path}: it was changed after it was built ({what}); nothing was "
                    f"trained on it. Remove that folder (rm -r {path}) and run again to rebuild it")


def _is_complete(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file()


def load_cache(path: Path, max_length: int, keep_last: bool = True) -> dict[str, TokenizedSplit]:
    """The cached splits, each sequence cut to max_length tokens.

    With keep_last (tokenizers that end a sequence with a special token, BERT's [SEP]) a cut
    sequence keeps its first max_length - 1 tokens and then its last: exactly what tokenising
    with truncation at max_length gives.
    """
    import datasets

    verify(path)
    loaded = datasets.load_from_disk(str(path))
    out = {}
    for name in SPLITS:
        column = loaded[name].data.column("input_ids").combine_chunks()
        ids = column.values.to_numpy().astype(np.int32)
        offsets = column.offsets.to_numpy().astype(np.int64)
        labels = np.asarray(loaded[name]["label"], dtype=np.int64)
        ids, offsets = truncate(ids, offsets - offsets[0], max_length, keep_last)
        out[name] = TokenizedSplit(ids, offsets, labels)
    return out


def truncate(ids: np.ndarray, offsets: np.ndarray, max_length: int, keep_last: bool) -> tuple[np.ndarray, np.ndarray]:
    """Flat token ids + offsets with every sequence cut to max_length (see load_cache)."""
    lengths = np.diff(offsets)
    if lengths.size == 0 or lengths.max() <= max_length:
        return ids, offsets
    kept = np.minimum(lengths, max_length)
    new_offsets = np.concatenate([[0], np.cumsum(kept)])
    # Position in the old array of every kept token: its sequence's old start + its place in it.
    source = np.arange(new_offsets[-1]) - np.repeat(new_offsets[:-1] - offsets[:-1], kept)
    if keep_last:
        cut = lengths > max_length
        source[new_offsets[1:][cut] - 1] = offsets[1:][cut] - 1
    return ids[source], new_offsets


def ends_with_special_token(tokenizer) -> bool:
    """Whether the tokenizer closes every sequence with a special token ([SEP], </s>)."""
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[-1] in set(tokenizer.all_special_ids)


def split_keys(path: Path) -> dict[str, list[str]]:
    """The review names in each cached split, in order (for fingerprint checks)."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    return {name: loaded[name]["key"] for name in SPLITS}


def prepare_splits(data_dir: Optional[str], cache_dir: Optional[str], tokenizer, max_length: int,
                   builds: bool = True, gather=lambda obj: [obj],
                   builder: int = 0) -> tuple[dict[str, TokenizedSplit], Path]:
    """Tokenised train/validation/test splits, cut to max_length.

    The processes that `builds` (under torchrun each node's LOCAL_RANK 0) find the data and build
    the cache, or find it built, in their own --cache-dir: nodes need not share a disk. `gather`
    (an all-gather over ranks) then hands every rank the outcomes: each reads the cache of its
    node's builder (global rank `builder`), and an error anywhere, or nodes whose data differ,
    stops every rank with the same one-line message instead of leaving them waiting on one that
    has stopped. Separate runs building the same cache at once (also nodes sharing --cache-dir)
    take turns on a lock file: one tokenises, the others wait for it and then read its finished cache.
    """
    outcome = None
    if builds:
        try:
            source = imdb.find_source(data_dir)
            root = cache_root(cache_dir)
            path = root / f"imdb-{cache_key(source, tokenizer)}"
            with reported(path):
                if not _is_complete(path):
                    _build_once(source, tokenizer, path)
            outcome = ("ok", str(path))
        except (DataError, DiskFull) as e:
            outcome = failure(e)
    path = agree(gather(outcome), builder)
    with reported(path):
        return load_cache(path, max_length, ends_with_special_token(tokenizer)), path


def failure(e: Exception) -> tuple[str, str]:
    """A builder's error as an outcome the other ranks can raise again (agree)."""
    return ("full" if isinstance(e, DiskFull) else "error", str(e))


def agree(outcomes: list, builder: int) -> Path:
    """The cache this rank reads (its node builder's), after every builder's outcome is known:
    the first error anywhere, or nodes whose data differ, stop every rank with one line."""
    errors = [(status, value) for status, value in filter(None, outcomes) if status != "ok"]
    if errors:
        status, message = errors[0]
        raise (DiskFull if status == "full" else DataError)(message)
    keys = {Path(value).name for status, value in filter(None, outcomes)}  # the key: data + tokenizer
    if len(keys) > 1:
        raise DataError(f"the nodes found different data ({', '.join(sorted(keys))}); "
                        f"give every node the same --data-dir contents")
    return Path(outcomes[builder][1])


def _build_once(source: Path, tokenizer, path: Path) -> None:
    build_once(path, lambda: build_cache(source, tokenizer, path))


def build_once(path: Path, build) -> None:
    """build() under an exclusive lock on <path>.lock: concurrent runs build it once.

    Nothing is left behind: the lock file goes when the build ends, and so do the cache folders
    made for it if the build failed (bad data leaves no trace in the cache folder).
    """
    made = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    lock_path = path.with_name(path.name + ".lock")
    try:
        fd = _lock(lock_path)
        try:
            if not _is_complete(path):  # another run may have built it while this one waited
                build()
        finally:
            with contextlib.suppress(OSError):
                lock_path.unlink()  # while still locked: a run that opened it meanwhile locks a new one (_lock)
            os.close(fd)
    finally:
        if not _is_complete(path):
            for folder in made:  # deepest first; one that holds something (another run's lock) stays
                try:
                    folder.rmdir()
                except OSError:
                    break


def _lock(lock_path: Path) -> int:
    """An exclusive flock on lock_path, created if missing; held until its descriptor is closed (or the process dies).

    The holder removes the file when done, so after locking we check that the file we hold is still
    the one at lock_path (as run_folder.RunFolderLock does); if not, we lock the new one.
    """
    while True:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock_path, os.O_RDONLY | os.O_CREAT, 0o666)  # read-only: another user's lock file will do
        except FileNotFoundError:  # the folder was removed by a failed build just now
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


@contextlib.contextmanager
def reported(path: Path):
    """OSErrors on the cache folder `path` as one line: a full disk (DiskFull: status 1), no permission
    (DataError naming the folder and whose it is); the build has removed its temporaries already."""
    try:
        yield
    except OSError as e:
        setting = cache_setting(str(path.parent))
        if _no_space(e):
            free = shutil.disk_usage(_existing(path)).free
            raise DiskFull(f"no space left in {path.parent} for the token cache {path.name}: {free:,} bytes free; "
                           f"free some space or choose another {setting}") from None
        if isinstance(e, PermissionError):
            raise DataError(_permission_line(path, setting)) from None
        raise DataError(f"cannot use the token cache {path}: {e.strerror or e} (choose another {setting})") \
            from None


def _no_space(e: BaseException | None) -> bool:
    """Whether e, or an error it was raised while handling, says the disk or quota is full."""
    while e is not None:
        if isinstance(e, OSError) and (e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e)):
            return True  # pyarrow's writers raise OSError("... No space left on device") without an errno
        e = e.__cause__ or e.__context__
    return False


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _permission_line(path: Path, setting: str) -> str:
    """Which cache folder is closed to this user, and whose it is."""
    for folder in (path, *path.parents):  # the cache itself, or the nearest folder above it we can see
        try:
            st = folder.stat()
            break
        except OSError:
            continue
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = f"uid {st.st_uid}"
    mode = stat.filemode(st.st_mode)
    if st.st_uid == os.getuid():
        return (f"no permission to use the token cache {folder} (yours, {mode}): chmod -R u+rwX {folder}, "
                f"or choose another {setting}")
    return (f"no permission to use the token cache {folder} ({owner}'s, {mode}): ask {owner} to open it to you "
            f"(chmod -R g+rwX {folder}), or choose another {setting}")
