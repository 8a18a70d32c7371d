"""The lock a token cache is built under (shared_cache.py's `build_once`): taken without waiting for
ever, and shown to be alive while the build goes on.

A run that finds the lock taken says so at once, in one line naming the lock and its holder
(process and user, from /proc/locks), and waits while the holder shows progress: a builder touches
its lock every HEARTBEAT_S seconds (`showing_progress`). After FASTPT_LOCK_WAIT seconds
(LOCK_WAIT_S by default) without progress it gives up with one line. A lock held by another user,
outside a trusted folder, is refused at once: what they build would not be used here. The lock
file is opened only as a regular file of the user's own, never through a symbolic link
(files/trust.py).
"""

import contextlib
import errno
import fcntl
import os
import sys
import threading
import time
from pathlib import Path

from fastpt.errors import DataError
from fastpt.files import trust

LOCK_WAIT_VARIABLE = "FASTPT_LOCK_WAIT"
LOCK_WAIT_S = 300.0  # seconds a run waits on a lock whose holder shows no progress
HEARTBEAT_S = 30.0  # a builder touches its lock this often: the progress a waiting run sees
POLL_S = 1.0  # a waiting run tries the lock again this often


def cache_setting(cache_dir: str | None) -> str:
    """The setting an error about the cache folder names: FASTPT_CACHE_DIR where the folder is its value
    (the run's config holds the resolved folder either way), else --cache-dir."""
    env = os.environ.get("FASTPT_CACHE_DIR")
    if env and (not cache_dir or Path(cache_dir).resolve() == Path(env).resolve()):
        return "FASTPT_CACHE_DIR"
    return "--cache-dir"


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
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)


def lock_patience() -> float:
    """FASTPT_LOCK_WAIT: how many seconds to wait on a lock whose holder shows no progress."""
    value = os.environ.get(LOCK_WAIT_VARIABLE, str(LOCK_WAIT_S))
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
                        f"cache folder your team shares on purpose, trust it: "
                        f"{trust.TRUST_VARIABLE}={lock_path.parent}")
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


def lock_holder(fd: int) -> tuple[int | None, int | None]:
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
