"""Whose files a run may use: the owner rule, and opening files that someone else could have planted.

On a cluster node other users share /scratch, /tmp and project folders. Whoever can write the
folder that holds your run folders or your FASTPT_CACHE_DIR could otherwise leave a checkpoint, a
token cache or compiled kernels there for your run to use, or a symbolic link for it to write
through. So before a run resumes from, writes into or locks a run folder, and before it uses a
cache entry, it applies OpenSSH's `StrictModes` rule (`refusal`):
- the file or folder is yours (or root's), and no one else can change it: not writable by others,
  nor by a group with anyone in it but you (a personal group, as most Linux systems give each
  user, is yours). A folder above it that others may write is fine with the sticky bit (/tmp's
  `t`): they can add entries there, never replace yours;
- a symbolic link counts as its owner's: one that someone else made is not followed;
- anything else is refused in one line naming it, its owner and mode, and how to proceed.

A team that shares runs or a cache on purpose names the folders it trusts, separated by colons:

    FASTPT_TRUST_DIRS=/proj/team/cache:/proj/team/runs

Inside them the rule is not applied, and what fastpt creates follows the umask (a teammate can
continue your run). Everywhere else fastpt creates nothing that others can change: the umask's
permissions without group and others' write (`folder_mode`, `file_mode`).

What keeps the process itself safe holds everywhere, trusted or not: a fixed name is never opened
through a symbolic link (O_NOFOLLOW), only regular files are read (a FIFO would hang the run,
/dev/zero fill its memory), JSON files are read up to `JSON_LIMIT`, and temporary files get random
names created exclusively (O_EXCL).
"""

import grp
import json
import os
import pwd
import stat
from pathlib import Path

TRUST_VARIABLE = "FASTPT_TRUST_DIRS"
JSON_LIMIT = 16 << 20  # bytes: far above any JSON fastpt writes (a config, a digest list, a cached figure)


# ---------------------------------------------------------------------------- trusted folders

def trusted(path: Path) -> bool:
    """Whether path is, or lies inside, a folder named in FASTPT_TRUST_DIRS."""
    real = Path(os.path.realpath(path))
    return any(real.is_relative_to(os.path.realpath(folder))
               for folder in os.environ.get(TRUST_VARIABLE, "").split(os.pathsep) if folder)


def folder_mode(path: Path) -> int:
    """The mode to create a folder at path with (the umask still applies)."""
    return 0o777 if trusted(path) else 0o755


def file_mode(path: Path) -> int:
    return 0o666 if trusted(path) else 0o644


# ---------------------------------------------------------------------------- the owner rule

def owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _personal_group(st: os.stat_result) -> bool:
    """The file's group holds its owner alone: the owner's own group (same name, same id, no other member)."""
    try:
        owner, group = pwd.getpwuid(st.st_uid), grp.getgrgid(st.st_gid)
    except KeyError:
        return False
    return group.gr_gid == owner.pw_gid and group.gr_name == owner.pw_name and set(group.gr_mem) <= {owner.pw_name}


def others_can_change(st: os.stat_result, sticky_ok: bool = False) -> bool:
    """Whether anyone but the owner (and root) can change this file or folder. With sticky_ok, a sticky
    folder's own entries count as safe (others may add theirs, not rename or remove those of its owner)."""
    if sticky_ok and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX:
        return False
    return bool(st.st_mode & stat.S_IWOTH) or bool(st.st_mode & stat.S_IWGRP) and not _personal_group(st)


def yours(st: os.stat_result) -> bool:
    return st.st_uid in (os.getuid(), 0)


def problem(path: Path, sticky_ok: bool = False) -> str | None:
    """What breaks the owner rule at path (the path itself; a symbolic link and what it points to), else None."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            if not yours(st):
                return f"is a symbolic link made by {owner_name(st.st_uid)}"
            st = os.stat(path)
    except FileNotFoundError:
        return None
    if not yours(st):
        return f"is {owner_name(st.st_uid)}'s, not yours ({stat.filemode(st.st_mode)})"
    if others_can_change(st, sticky_ok):
        return f"can be changed by others ({stat.filemode(st.st_mode)})"
    return None


def refusal(path: Path, what: str, advice: str) -> str | None:
    """The line refusing `what` at path if it breaks the owner rule and is not trusted, else None.

    `advice` is what to do instead ("choose another --out"); the line adds the trust that a team
    sharing the folder on purpose can give."""
    found = None if trusted(path) else problem(path)
    if found is None:
        return None
    fix = f"make it yours alone (chmod go-w {path}), " if found.startswith("can be changed") else ""
    return (f"refused {what} {path}: it {found}; fastpt uses only what you own and no one else can change. "
            f"{(fix + advice)[0].upper()}{(fix + advice)[1:]}, or, for a folder your team shares on purpose, "
            f"trust it: {TRUST_VARIABLE}={Path(os.path.realpath(path)).parent}")


def chain_problem(folder: Path) -> str | None:
    """The owner rule for a folder and every folder above it (StrictModes' walk), each holding what lies
    below it (so a sticky one is fine): what breaks it, else None. Whoever can replace a folder on the
    way replaces everything below it; a trusted folder ends the walk."""
    folder = Path(os.path.abspath(folder))
    for folder in (folder, *folder.parents):
        if trusted(folder):
            return None
        found = problem(folder, sticky_ok=True)
        if found is not None:
            return f"{folder} {found}"
    return None


# ---------------------------------------------------------------------------- opening planted names safely

class NotRegular(OSError):
    """A name that is not a regular file: a FIFO, a device, a folder."""


# What a name is, by the letter `ls -l` (stat.filemode) shows for it.
KINDS = {"p": "a FIFO (named pipe)", "c": "a character device", "b": "a block device", "s": "a socket",
         "d": "a folder", "l": "a symbolic link"}


def kind(mode: int) -> str:
    return KINDS.get(stat.filemode(mode)[0], "not a regular file")


def open_regular(path: Path, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor of the regular file at path, opened without following a symbolic link there
    (OSError ELOOP) and without waiting on a FIFO (NotRegular, as for any other kind of file)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegular(f"{path} is {kind(st.st_mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_json(path: Path, limit: int = JSON_LIMIT):
    """A JSON file, read from the regular file at path (never through a symbolic link); OSError or ValueError
    when it cannot be, ValueError beyond `limit` bytes."""
    with os.fdopen(open_regular(path), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit:,} bytes")
    return json.loads(data)
