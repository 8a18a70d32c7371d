"""`<out>/.lock`: the run folder's exclusive flock, held for the whole run (run_folder.py claims it)."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from fastpt.files import trust

LOCK_NAME = ".lock"


def check_owner(path: Path, what: str, advice: str = "choose another --out") -> None:
    """ValueError unless path passes the owner rule (files/trust.py): the line says how to proceed."""
    if refused := trust.refusal(path, what, advice):
        raise ValueError(refused)


class RunFolderLock:
    """`<out>/.lock`, exclusively flock-ed by the one run that writes in `out`.

    The folder (and any missing parent) is created to hold the lock; `release(keep=False)` removes
    what was created, so a refused run leaves no trace. The file is removed on release, while
    still locked; a run that opened it just before then finds it replaced and locks the new one.
    """

    def __init__(self, out: Path, new: bool = False):
        self.out, self.path, self.fd, self.new = out, out / LOCK_NAME, None, new
        self.created = [p for p in (out, *out.parents) if not p.exists()]

    def acquire(self) -> "RunFolderLock":
        try:
            if self.new:
                self._make_new_folder()
            self.out.mkdir(mode=trust.folder_mode(self.out), parents=True, exist_ok=True)
            check_owner(self.out, "--out")
            while True:
                fd = self._open_lock()
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                    os.close(fd)
                    raise ValueError(f"--out {self.out} is in use by another run (process {holder}); "
                                     f"wait for it or choose another folder") from None
                if self.path.exists() and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
                os.close(fd)  # the previous holder removed the file after we opened it: lock the new one
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self.fd = fd
        except ValueError:
            self.release(keep=False)
            raise
        except OSError as e:
            self.release(keep=False)
            raise ValueError(f"--out {self.out}: cannot write there ({e.strerror or e})") from None
        return self

    def _open_lock(self) -> int:
        """`.lock`, opened (created if missing) never through a symbolic link and only if it is a regular file
        of this user's: its pid is written into it, so a link planted there would have that written over
        another file."""
        try:
            fd = trust.open_regular(self.path, os.O_RDWR | os.O_CREAT, trust.file_mode(self.path))
        except OSError as e:
            if e.errno != errno.ELOOP and not isinstance(e, trust.NotRegular):
                raise
            what = "a symbolic link" if e.errno == errno.ELOOP else trust.kind(os.lstat(self.path).st_mode)
            raise ValueError(f"--out {self.out}: its {LOCK_NAME} is {what}, not a file fastpt made; fastpt never "
                             f"writes through one: remove it if it is yours, or choose another --out") from None
        try:
            check_owner(self.path, "the lock file")
        except ValueError:
            os.close(fd)
            raise
        return fd

    def _make_new_folder(self) -> None:
        """out, or out-2, out-3, ...: the first that does not exist yet. mkdir is atomic, so runs
        started in the same second (the default folder's name) each get a folder of their own."""
        self.out.parent.mkdir(parents=True, exist_ok=True)
        base, n = self.out, 1
        while True:
            try:
                self.out.mkdir(mode=trust.folder_mode(self.out))
                break
            except FileExistsError:
                n += 1
                self.out = base.with_name(f"{base.name}-{n}")
        self.path = self.out / LOCK_NAME
        self.created = [self.out, *(p for p in self.created if p != base)]  # deepest first

    def release(self, keep: bool = True) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None
        if not keep:
            for folder in self.created:  # deepest first
                try:
                    folder.rmdir()
                except OSError:
                    break
