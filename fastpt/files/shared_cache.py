"""A cache folder many runs and users share: built once, published whole, checked on every load.

The token caches (inputs/token_cache.py for IMDB, inputs/own_data.py for --data) are built by
whichever run needs them first and read by every later one, also by other runs at the same time
and, with one FASTPT_CACHE_DIR for a team, by other users. What that takes:
- one build: concurrent runs take turns on a lock file (`build_once`); one builds, the others
  wait and then read its finished folder. Nothing is left behind: the lock file goes when the
  build ends, and so do the folders made for a build that failed;
- no waiting for ever (`take_lock`): a run that finds the lock taken says so at once, in one
  line naming the lock and its holder (process and user, from /proc/locks), and waits while
  the holder shows progress: a builder touches its lock every HEARTBEAT_S seconds. After
  FASTPT_LOCK_WAIT seconds (LOCK_WAIT_S by default) without progress it gives up with one line.
  A lock held by another user, outside a trusted folder, is refused at once: what they build
  would not be used here;
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
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from fastpt.errors import DataError, DiskFull
from fastpt.files import trust

DIGEST = "fastpt_digest.json"  # the SHA-256 of every other file of a cache folder, written when it is built


def cache_setting(cache_dir: Optional[str]) -> str:
    """The setting an error about the cache folder names: FASTPT_CACHE_DIR where the folder is its value
    (the run's config holds the resolved folder either way), else --cache-dir."""
    env = os.environ.get("FASTPT_CACHE_DIR")
    if env and (not cache_dir or Path(cache_dir).resolve() == Path(env).resolve()):
        return "FASTPT_CACHE_DIR"
    return "--cache-dir"


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
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            digests[name] = h.hexdigest()
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


LOCK_WAIT_VARIABLE = "FASTPT_LOCK_WAIT"
LOCK_WAIT_S = 300.0  # seconds a run waits on a lock whose holder shows no progress
HEARTBEAT_S = 30.0  # a builder touches its lock this often: the progress a waiting run sees
POLL_S = 1.0  # a waiting run tries the lock again this often


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
def showing_progress(fd: int):
    """Touch the lock file every HEARTBEAT_S seconds while the body runs."""
    stop = threading.Event()

    def beat():
        while not stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(fd)

    beating = threading.Thread(target=beat, name="lock-heartbeat", daemon=True)
    beating.start()
    try:
        yield
    finally:
        stop.set()
        beating.join()


def take_lock(lock_path: Path) -> int:
    """An exclusive flock on lock_path, created if missing; held until its descriptor is closed (or the process dies).

    The holder removes the file when done, so after locking we check that the file we hold is still
    the one at lock_path (as run_folder.RunFolderLock does); if not, we lock the new one. The name is
    opened only as a regular file and never through a symbolic link (files/trust.py), read-only: a
    teammate's lock file in a trusted folder will do. Created 0600 outside a trusted folder, so that
    no other user can open it to hold it.
    """
    patience = lock_patience()
    while True:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = trust.open_regular(lock_path, os.O_RDONLY | os.O_CREAT, 0o666 if trust.trusted(lock_path) else 0o600)
        except FileNotFoundError:  # the folder was removed by a failed build just now
            continue
        except OSError as e:
            if e.errno != errno.ELOOP and not isinstance(e, trust.NotRegular):
                raise
            what = "a symbolic link" if e.errno == errno.ELOOP else trust.kind(os.lstat(lock_path).st_mode)
            raise DataError(f"the token cache's lock {lock_path} is {what}, not a lock file any run makes: remove it "
                            f"if you may, or choose another {cache_setting(str(lock_path.parent))}") from None
        try:
            wait_for(fd, lock_path, patience)
        except BaseException:
            os.close(fd)
            raise
        try:
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def lock_patience() -> float:
    """FASTPT_LOCK_WAIT: how many seconds to wait on a lock whose holder shows no progress."""
    value = os.environ.get(LOCK_WAIT_VARIABLE)
    if value is None:
        return LOCK_WAIT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise DataError(f"{LOCK_WAIT_VARIABLE}={value}: expected a number of seconds > 0")
    return seconds


def wait_for(fd: int, lock_path: Path, patience: float) -> None:
    """flock(fd); if another process holds the lock, one line at once, then wait while its holder shows progress.

    Progress is a newer time on the lock file (the builder's heartbeat) or on a build folder beside
    it. A holder of another user's, outside a trusted folder, is not waited for.
    """
    if try_lock(fd):
        return
    pid, uid = lock_holder(fd)
    holder = "another process" if pid is None else f"process {pid}" + (
        "" if uid is None else f" of user {trust.owner_name(uid)}")
    setting = cache_setting(str(lock_path.parent))
    file_owner = os.fstat(fd).st_uid
    if {uid, file_owner} - {None, os.getuid(), 0} and not trust.trusted(lock_path):
        whose = "" if file_owner in (uid, os.getuid(), 0) else f" (its file is {trust.owner_name(file_owner)}'s)"
        raise DataError(f"the token cache's lock {lock_path} is held by {holder}{whose}: a cache another user builds "
                        f"is not used here, so this run does not wait for it. Choose another {setting}, or, for a "
                        f"cache folder your team shares on purpose, trust it: {trust.TRUST_VARIABLE}={lock_path.parent}")
    print(f"waiting for {lock_path}: {holder} holds it (building that token cache); giving up after {patience:g} s "
          f"without progress ({LOCK_WAIT_VARIABLE}=seconds waits longer)", file=sys.stderr, flush=True)
    seen, since = progress_mark(fd, lock_path), time.monotonic()
    while not try_lock(fd):
        time.sleep(POLL_S)
        mark = progress_mark(fd, lock_path)
        if mark != seen:
            seen, since = mark, time.monotonic()
        elif time.monotonic() - since > patience:
            raise DataError(f"gave up waiting for {lock_path}: {holder} holds it and showed no progress for "
                            f"{patience:g} s; if it is a build of yours, wait for it ({LOCK_WAIT_VARIABLE}=seconds "
                            f"waits longer), else choose another {setting}")


def try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def progress_mark(fd: int, lock_path: Path) -> tuple:
    """What changes while a build goes on: the lock file's time, and those of build folders beside it."""
    target = lock_path.name.removesuffix(".lock")
    folders = []
    for folder in lock_path.parent.glob(f".tmp-{target}-*"):
        with contextlib.suppress(OSError):
            folders.append(folder.stat().st_mtime_ns)
    return os.fstat(fd).st_mtime_ns, max(folders, default=0)


def lock_holder(fd: int) -> tuple[Optional[int], Optional[int]]:
    """(pid, uid) of the process holding a flock on fd's file, where Linux's /proc/locks says; else Nones."""
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK" or fields[5] != device:
            continue  # "->": a process waiting for the lock, not holding it
        pid = int(fields[4]) if fields[4].isdigit() else 0
        if pid <= 0:
            return None, None
        try:
            return pid, os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return pid, None
    return None, None


@contextlib.contextmanager
def reported(path: Path):
    """OSErrors on the cache folder `path` as one line: a full disk (DiskFull: status 1), no permission
    (DataError naming the folder and whose it is); the build has removed its temporaries already."""
    try:
        yield
    except OSError as e:
        setting = cache_setting(str(path.parent))
        if no_space(e):
            free = shutil.disk_usage(existing_parent(path)).free
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
    errors = [(status, value) for status, value in filter(None, outcomes) if status != "ok"]
    if errors:
        status, message = errors[0]
        raise (DiskFull if status == "full" else DataError)(message)
    keys = {Path(value).name for status, value in filter(None, outcomes)}  # the key: data + tokenizer
    if len(keys) > 1:
        raise DataError(f"the nodes found different data ({', '.join(sorted(keys))}); "
                        f"give every node the same --data-dir contents")
    return Path(outcomes[builder][1])


def no_space(e: BaseException | None) -> bool:
    """Whether e, or an error it was raised while handling, says the disk or quota is full."""
    while e is not None:
        if isinstance(e, OSError) and (e.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e)):
            return True  # pyarrow's writers raise OSError("... No space left on device") without an errno
        e = e.__cause__ or e.__context__
    return False


def existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def permission_line(path: Path, setting: str) -> str:
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
