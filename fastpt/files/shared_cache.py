"""A cache folder many runs and users share: built once, published whole, checked on every load.

The token caches (inputs/token_cache.py for IMDB, inputs/own_data.py for --data) are built by
whichever run needs them first and read by every later one, also by other runs at the same time
and, with one FASTPT_CACHE_DIR for a team, by other users. What that takes:
- one build: concurrent runs take turns on a lock file (`build_once`); one builds, the others
  wait and then read its finished folder. Nothing is left behind: the lock file goes when the
  build ends, and so do the folders made for a build that failed;
- no waiting for ever (files/cache_lock.py's `take_lock`): a run that finds the lock taken says
  so at once, in one line naming the lock and its holder (process and user, from /proc/locks),
  and waits while the holder shows progress: a builder touches its lock every HEARTBEAT_S
  seconds. After FASTPT_LOCK_WAIT seconds (LOCK_WAIT_S by default) without progress it gives up
  with one line. A lock held by another user, outside a trusted folder, is refused at once: what
  they build would not be used here;
- no half-built folder in place: a build writes into a temporary folder beside the target and
  renames it into place in one step (`publish`). The temporary folder gets the umask's
  permissions (not mkdtemp's 0700), so teammates can read the cache, less group and others'
  write outside a folder trusted for team use (files/trust.py);
- no trust on load: the cache is used only if every file and folder in it passes the owner
  rule (files/trust.py: yours, and no one else can change it; FASTPT_TRUST_DIRS names a team's
  cache folder) and is a plain file or folder (no symbolic link, FIFO or device). And the key
  names the data, but nothing on load would check the files against it, so `publish` records
  the SHA-256 of every file (`fastpt_digest.json`) and every load recomputes them (`verify`): a
  cache changed afterwards (labels rewritten, say) is refused with one line, not trained on.
  Hashing is cheap next to loading: the 50,000 reviews' 54 MB in 0.14 s, of a 2.9 s load
  (2 shared CPU cores; docs/results.md). In a trusted folder the digest is all there
  is: someone able to write there who also rewrites the digest goes unnoticed, so trust a
  folder only if you would train on the builds of everyone who can write it;
- one line for every failure (`reported`): a full disk (status 1), a folder closed to this user
  (naming it and whose it is); under torchrun every rank stops with the same line (`agree`).
"""

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import stat
from pathlib import Path

from fastpt.errors import DataError, DiskFull, disk_full
from fastpt.files import trust
from fastpt.files.cache_lock import cache_setting, showing_progress, take_lock  # noqa: F401 (cache_setting: shell.py's)

DIGEST = "fastpt_digest.json"  # the SHA-256 of every other file of a cache folder, written when it is built


def new_temporary(target: Path) -> Path:
    """An empty folder beside target to build in, with the permissions the umask gives, less group and
    others' write unless the folder is trusted for team use (files/trust.py).

    Not `tempfile.mkdtemp`: its mode 0700 would survive the rename, and teammates sharing the
    cache folder could not read the cache (run_folder's files follow the umask the same way).
    """
    while True:
        tmp = target.with_name(f".tmp-{target.name}-{secrets.token_hex(4)}")
        try:
            tmp.mkdir(mode=trust.folder_mode(target))
            return tmp
        except FileExistsError:
            continue


def publish(tmp: Path, target: Path) -> None:
    """Record the digest of everything built in tmp, then rename it to target in one step.

    If another process published the same cache first (same key, same content), its copy is kept.
    What the build's writers created with the umask's group write loses it outside a trusted folder:
    the cache must pass the owner rule that every load applies.
    """
    (tmp / DIGEST).write_text(json.dumps({"sha256": file_digests(tmp)}, indent=1))
    if not trust.trusted(target):
        for entry in (tmp, *tmp.rglob("*")):
            mode = stat.S_IMODE(entry.lstat().st_mode)
            if mode & 0o022 and not entry.is_symlink():
                entry.chmod(mode & ~0o022)
    try:
        os.rename(tmp, target)
    except OSError:
        if not is_complete(target):  # not another build's finished copy: a real failure
            raise


def file_digests(folder: Path) -> dict[str, str]:
    """{path inside folder: SHA-256 of its bytes} for every file but the digest file itself."""
    digests = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and name != DIGEST:
            with open(path, "rb") as f:
                digests[name] = hashlib.file_digest(f, "sha256").hexdigest()
    return digests


def verify(path: Path) -> None:
    """DataError unless the cache passes the owner rule (`check_cache_files`) and every file of it is byte for
    byte what its build recorded.

    A changed, added or removed file, or a changed digest file, is refused: nothing trains on it.
    """
    check_cache_files(path)
    try:
        recorded = trust.read_json(path / DIGEST)["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        recorded = None
    found = file_digests(path)
    if recorded == found:
        return
    if isinstance(recorded, dict):
        changed = sorted(set(recorded) ^ set(found) | {n for n in found if recorded.get(n) != found[n]})
        what = f"{changed[0]}{f' and {len(changed) - 1} more' if len(changed) > 1 else ''} differ from its digest"
    else:
        what = f"its digest file {DIGEST} is missing or unreadable"
    raise DataError(f"refused the token cache {path}: it was changed after it was built ({what}); nothing was "
                    f"trained on it. Remove that folder (rm -r {path}) and run again to rebuild it")


def check_cache_files(path: Path) -> None:
    """DataError unless every entry of the cache folder is a plain file or folder (never a symbolic link,
    a FIFO or a device: reading one would follow it elsewhere, hang or fill memory) and, outside a
    trusted folder, passes the owner rule (files/trust.py): yours, and no one else can change it."""
    setting, trusted = cache_setting(str(path.parent)), trust.trusted(path)
    for folder, names, files in os.walk(path):
        for entry in (Path(folder), *(Path(folder) / name for name in [*names, *files])):
            where = "it" if entry == path else entry.relative_to(path).as_posix()
            mode = entry.lstat().st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise DataError(f"refused the token cache {path}: {where} is {trust.kind(mode)}, which no build "
                                f"writes; nothing was trained on it. Remove that folder if you may (rm -r {path}), "
                                f"or choose another {setting}")
            found = None if trusted else trust.problem(entry)
            if found:
                fix = (f"make it yours alone (chmod -R go-w {path})" if found.startswith("can be changed")
                       else f"remove that folder if you may (rm -r {path}) or choose another {setting}")
                raise DataError(f"refused the token cache {path}: {where} {found}; a cache is used only if you "
                                f"built it and no one else can change it, and nothing was trained on it. "
                                f"{fix[0].upper()}{fix[1:]}, or, for a cache folder your team shares on purpose, "
                                f"trust it: {trust.TRUST_VARIABLE}={path.parent}")


def is_complete(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file()


def build_once(path: Path, build) -> None:
    """build() under an exclusive lock on <path>.lock: concurrent runs build it once.

    Nothing is left behind: the lock file goes when the build ends, and so do the cache folders
    made for it if the build failed (bad data leaves no trace in the cache folder). While building,
    the lock is touched every HEARTBEAT_S seconds: runs waiting on it see that the build goes on.
    """
    made = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    lock_path = path.with_name(path.name + ".lock")
    try:
        fd = take_lock(lock_path)
        try:
            if not is_complete(path):  # another run may have built it while this one waited
                with showing_progress(fd):
                    build()
        finally:
            with contextlib.suppress(OSError):
                lock_path.unlink()  # while still locked: a run that opened it meanwhile locks a new one (take_lock)
            os.close(fd)
    finally:
        if not is_complete(path):
            for folder in made:  # deepest first; one that holds something (another run's lock) stays
                try:
                    folder.rmdir()
                except OSError:
                    break


@contextlib.contextmanager
def reported(path: Path):
    """OSErrors on the cache folder `path` as one line: a full disk (DiskFull: status 1), no permission
    (DataError naming the folder and whose it is); the build has removed its temporaries already."""
    try:
        yield
    except OSError as e:
        setting = cache_setting(str(path.parent))
        if disk_full(e):
            free = shutil.disk_usage(nearest_seen(path)[0]).free
            raise DiskFull(f"no space left in {path.parent} for the token cache {path.name}: {free:,} bytes free; "
                           f"free some space or choose another {setting}") from None
        if isinstance(e, PermissionError):
            raise DataError(permission_line(path, setting)) from None
        raise DataError(f"cannot use the token cache {path}: {e.strerror or e} (choose another {setting})") \
            from None


def failure(e: Exception) -> tuple[str, str]:
    """A builder's error as an outcome the other ranks can raise again (agree)."""
    return ("full" if isinstance(e, DiskFull) else "error", str(e))


def agree(outcomes: list, builder: int) -> Path:
    """The cache this rank reads (its node builder's), after every builder's outcome is known:
    the first error anywhere, or nodes whose data differ, stop every rank with one line."""
    for status, message in filter(None, outcomes):  # the first error anywhere
        if status != "ok":
            raise (DiskFull if status == "full" else DataError)(message)
    keys = {Path(value).name for status, value in filter(None, outcomes)}  # the key: data + tokenizer
    if len(keys) > 1:
        raise DataError(f"the nodes found different data ({', '.join(sorted(keys))}); "
                        f"give every node the same --data-dir contents")
    return Path(outcomes[builder][1])


def nearest_seen(path: Path) -> tuple[Path, os.stat_result]:
    """The cache itself, or the nearest folder above it this user can see, and its stat."""
    for folder in (path, *path.parents):
        with contextlib.suppress(OSError):
            return folder, folder.stat()


def permission_line(path: Path, setting: str) -> str:
    """Which cache folder is closed to this user, and whose it is."""
    folder, st = nearest_seen(path)
    owner, mode = trust.owner_name(st.st_uid), stat.filemode(st.st_mode)
    if st.st_uid == os.getuid():
        return (f"no permission to use the token cache {folder} (yours, {mode}): chmod -R u+rwX {folder}, "
                f"or choose another {setting}")
    return (f"no permission to use the token cache {folder} ({owner}'s, {mode}): ask {owner} to open it to you "
            f"(chmod -R g+rwX {folder}), or choose another {setting}")
