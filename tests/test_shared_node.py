"""Another user on the same node (files/trust.py): someone who can write a shared cache folder or the folder
that holds your run folders can neither run code in your run, overwrite, truncate nor poison your files,
nor block your run for ever.

The other user is a second Unix user (made for the tests where they run as root) acting through files
given to them with chown and, for a lock held by another user, through a process of theirs. Every
refusal is one line on stderr and status 2, and leaves the victim's files as they were.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import flip_labels

from fastpt.files import cache_lock, shared_cache
from fastpt.inputs import imdb, token_cache
from fastpt.inputs.models import load_tokenizer
from fastpt.monitoring import peak
from train import main

OTHER = "fastpt-other"


@pytest.fixture(scope="session")
def other():
    """(uid, gid, name) of a second Unix user, made for the session if missing (and removed after it)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: files and processes of a second user are made with chown and setuid")
    created = False
    try:
        user = pwd.getpwnam(OTHER)
    except KeyError:
        made = subprocess.run(["useradd", "--system", "--no-create-home", "--user-group", "--shell",
                               "/usr/sbin/nologin", OTHER], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"cannot create a second user: {made.stderr.strip()}")
        created, user = True, pwd.getpwnam(OTHER)
    yield user.pw_uid, user.pw_gid, OTHER
    if created:
        subprocess.run(["userdel", OTHER], capture_output=True)


def give(path: Path, user) -> None:
    """path and everything below it now belong to the other user (links themselves, not what they point to)."""
    uid, gid, _ = user
    for entry in (path, *path.rglob("*")) if path.is_dir() and not path.is_symlink() else (path,):
        os.lchown(entry, uid, gid)


@pytest.fixture
def shared():
    """A folder everyone may write, with the sticky bit, as /scratch on a cluster; reachable by the other user."""
    folder = Path(tempfile.mkdtemp(prefix="fastpt-shared-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def run_flags(imdb_dir, cache, out, *extra):
    return ["--model", "tiny", "--data-dir", str(imdb_dir), "--cache-dir", str(cache), "--max-length", "32",
            "--batch-size", "8", "--train-size", "16", "--epochs", "1", "--max-steps", "2", "--no-progress",
            "--no-tensorboard", "--out", str(out), *extra]


def refused(args, capfd) -> str:
    """Runs the command, expects status 2 and one line on stderr; returns the line."""
    capfd.readouterr()
    assert main(args) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    print(err[0])  # shown with the test's report (pytest -rA)
    return err[0]


def snapshot(folder: Path) -> dict:
    """Every path under folder (links not followed) with its owner and bytes, or its link target."""
    return {str(p.relative_to(folder)): (p.lstat().st_uid, os.readlink(p) if p.is_symlink()
                                         else p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


# ---------------------------------------------------------------------------- 0. compiled kernels

def compiled_in(monkeypatch) -> list:
    """Replaces torch.compile by a probe that records where torch's cache is (a real compile takes minutes)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache_dir()  # what `import torch._dynamo` does in a fresh process: torch's default written into the variable
    seen = []

    def probe(target, **options):
        seen.append(cache_dir())
        return target

    monkeypatch.setattr(torch, "compile", probe)
    return seen


def test_compiled_kernels_are_kept_in_a_folder_of_the_users_own_not_in_the_shared_cache(
        other, shared, imdb_dir, tmp_path, monkeypatch):
    planted = shared / "inductor"  # where every user of a shared cache used to load kernels from
    planted.mkdir()
    (planted / "kernel.py").write_text("raise SystemExit('planted kernel ran')\n")
    give(planted, other)
    seen = compiled_in(monkeypatch)
    assert main(run_flags(imdb_dir, shared, tmp_path / "run", "--compile")) == 0
    own = shared / f"inductor-{os.getuid()}"
    assert seen and set(seen) == {str(own)}
    st = own.lstat()
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert sorted(p.name for p in planted.iterdir()) == ["kernel.py"]


@pytest.mark.parametrize("attack", ["a folder of theirs at your name", "a cache folder anyone may change"])
def test_a_compile_cache_another_user_can_change_is_refused_before_the_run(
        attack, other, shared, imdb_dir, tmp_path, monkeypatch, capfd):
    if attack == "a folder of theirs at your name":
        cache = shared
        (cache / f"inductor-{os.getuid()}").mkdir(mode=0o777)
        give(cache / f"inductor-{os.getuid()}", other)
    else:
        cache = shared / "open"
        cache.mkdir()
        cache.chmod(0o777)  # no sticky bit: anyone may rename your kernels' folder away and put theirs there
    seen = compiled_in(monkeypatch)
    line = refused(run_flags(imdb_dir, cache, tmp_path / "run", "--compile"), capfd)
    assert f"refused the compile cache {cache / f'inductor-{os.getuid()}'}" in line
    assert ("fastpt-other's, not yours" if attack.startswith("a folder") else "can be changed by others") in line
    assert "TORCHINDUCTOR_CACHE_DIR" in line
    assert seen == [] and not (tmp_path / "run").exists()

    if attack == "a cache folder anyone may change":  # a team that shares it on purpose says so
        monkeypatch.setenv("FASTPT_TRUST_DIRS", str(cache))
        assert main(run_flags(imdb_dir, cache, tmp_path / "run", "--compile")) == 0
        assert set(seen) == {str(cache / f"inductor-{os.getuid()}")}


# ---------------------------------------------------------------------------- 1, 6. the peak FLOP/s cache

@pytest.fixture
def short_probe(monkeypatch):
    monkeypatch.setattr(peak, "PROBE_S", 0.02)
    monkeypatch.setattr(peak, "SQUARE", 256)


def peak_file_name(tmp_path) -> str:
    """The peak cache's file name for the tests' probe (its key does not depend on the folder)."""
    peak.measured_peak(torch.device("cpu"), torch.float32, 64, tmp_path / "probe")
    [path] = (tmp_path / "probe" / "peak").glob("peak-*.json")
    return path.name


@pytest.mark.parametrize("where", ["their folder", "links in yours"])
def test_the_peak_cache_never_writes_through_a_link_planted_at_its_names(where, other, shared, tmp_path, short_probe):
    victim = tmp_path / "thesis.tex"  # any file the victim can write
    victim.write_text("years of work\n")
    name = peak_file_name(tmp_path)
    root = shared if where == "their folder" else tmp_path / "cache"
    folder = root / "peak"
    folder.mkdir(parents=True)
    links = [folder / name, *(folder / f"{name}.{pid}.tmp" for pid in range(os.getpid() - 5, os.getpid() + 5))]
    for link in links:  # the final name and the temporary names the cache once used (<name>.<pid>.tmp)
        link.symlink_to(victim)
    if where == "their folder":
        folder.chmod(0o777)
        give(folder, other)
    else:
        for link in links:
            give(link, other)
    found = peak.measured_peak(torch.device("cpu"), torch.float32, 64, root)
    assert found["source"] == "measured at the start of this run" and found["flops_per_s"] > 0
    assert victim.read_text() == "years of work\n"
    if where == "links in yours":  # replaced by a cache file of the user's own, the links at other names left
        path = folder / name
        assert not path.is_symlink() and path.lstat().st_uid == os.getuid()
        assert json.loads(path.read_text())["flops_per_s"] == found["flops_per_s"]
        assert all(link.is_symlink() for link in links[1:])


@pytest.mark.timeout(120)  # before the fix a FIFO hung the run and /dev/zero filled its memory
@pytest.mark.parametrize("planted", ["fifo", "link to /dev/zero"])
def test_a_peak_cache_name_that_is_not_a_file_is_measured_again_without_hanging(planted, tmp_path, short_probe):
    name = peak_file_name(tmp_path)
    folder = tmp_path / "cache" / "peak"
    folder.mkdir(parents=True)
    if planted == "fifo":
        os.mkfifo(folder / name)
    else:
        (folder / name).symlink_to("/dev/zero")
    found = peak.measured_peak(torch.device("cpu"), torch.float32, 64, tmp_path / "cache")
    assert found["source"] == "measured at the start of this run"
    assert stat.S_ISREG((folder / name).lstat().st_mode)  # replaced by a cache file


# ---------------------------------------------------------------------------- 2, 3, 7. the run folder

@pytest.fixture(scope="module")
def stopped_run(imdb_dir, cache_dir, tmp_path_factory) -> Path:
    """A run with checkpoints/last.pt at step 2 that --resume auto with a larger --max-steps continues."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    assert main(run_flags(imdb_dir, cache_dir, out, "--save-every", "1")) == 0
    return out


def test_a_lock_file_that_is_a_link_is_never_written_through(stopped_run, imdb_dir, cache_dir, tmp_path, capfd):
    victim = tmp_path / "thesis.tex"
    victim.write_text("years of work\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").symlink_to(victim)
    line = refused(run_flags(imdb_dir, cache_dir, out), capfd)
    assert f"--out {out}: its .lock is a symbolic link" in line and "never writes through one" in line
    assert victim.read_text() == "years of work\n"
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing trained into the folder


@pytest.mark.parametrize("planted", ["their run folder", "their last.pt", "a run folder anyone may change",
                                     "their empty folder"])
def test_a_run_folder_another_user_can_change_is_neither_resumed_nor_written(
        planted, other, stopped_run, imdb_dir, cache_dir, shared, monkeypatch, capfd):
    out = shared / "runs" / "run"  # a world-writable parent, as a project's shared folder
    out.parent.mkdir()
    out.parent.chmod(0o777)
    if planted == "their empty folder":
        out.mkdir()
        give(out, other)
    else:
        shutil.copytree(stopped_run, out)
        if planted == "their run folder":
            give(out, other)
        elif planted == "their last.pt":
            give(out / "checkpoints" / "last.pt", other)
        else:
            out.chmod(0o777)
    before = snapshot(out)
    line = refused(run_flags(imdb_dir, cache_dir, out, "--resume", "auto", "--epochs", "2", "--max-steps", "3"), capfd)
    what = {"their last.pt": f"the checkpoint {out / 'checkpoints' / 'last.pt'}"}.get(planted, f"--out {out}")
    assert f"refused {what}: it " in line
    assert ("can be changed by others" if planted.startswith("a run") else "fastpt-other's, not yours") in line
    assert "FASTPT_TRUST_DIRS=" in line
    assert snapshot(out) == before  # no lock left in it, no checkpoint read into a run, nothing written

    if planted == "their run folder":  # a team that shares its runs on purpose continues them
        from fastpt.files.checkpoint import load

        monkeypatch.setenv("FASTPT_TRUST_DIRS", str(out.parent))
        assert load(out / "checkpoints" / "last.pt")["progress"]["global_step"] == 2
        assert main(run_flags(imdb_dir, cache_dir, out, "--resume", "auto", "--epochs", "2", "--max-steps", "3",
                              "--save-every", "1")) == 0
        assert load(out / "checkpoints" / "last.pt")["progress"]["global_step"] == 3


def test_new_run_folders_and_files_keep_others_out_whatever_the_umask(imdb_dir, cache_dir, tmp_path):
    previous = os.umask(0o002)
    try:
        assert main(run_flags(imdb_dir, cache_dir, tmp_path / "runs" / "run", "--save-every", "1")) == 0
    finally:
        os.umask(previous)
    out = tmp_path / "runs" / "run"
    made = [out, out / "checkpoints", *(p for p in out.rglob("*") if p.is_file())]
    assert len(made) > 6  # the marker, config.json, results.json, predictions.csv, best.pt, last.pt
    writable = {str(p.relative_to(tmp_path)): stat.filemode(p.stat().st_mode) for p in made
                if p.stat().st_mode & 0o022}
    assert writable == {}


def test_overwrite_never_replaces_a_run_through_a_link(stopped_run, imdb_dir, cache_dir, tmp_path, capfd):
    precious = tmp_path / "runs" / "precious"
    shutil.copytree(stopped_run, precious)
    link = tmp_path / "runs" / "linkout"
    link.symlink_to("precious")
    before = snapshot(precious)
    line = refused(run_flags(imdb_dir, cache_dir, link, "--overwrite"), capfd)
    assert f"--out {link} is a symbolic link (to precious)" in line and "--overwrite never replaces" in line
    assert snapshot(precious) == before and link.is_symlink()


# ---------------------------------------------------------------------------- 4, 6. the token cache

def imdb_cache(imdb_dir, cache: Path) -> Path:
    _, path = token_cache.prepare_splits(str(imdb_dir), str(cache), load_tokenizer("tiny"), 32)
    return path


def flip_labels_and_digest(path: Path) -> None:
    """What another user who can write the folder could do: every label flipped, and the digest written again."""
    flip_labels(path)
    (path / shared_cache.DIGEST).write_text(json.dumps({"sha256": shared_cache.file_digests(path)}))


def test_a_token_cache_another_user_built_or_changed_is_refused(other, imdb_dir, tmp_path, monkeypatch, capfd):
    cache = tmp_path / "cache"
    path = imdb_cache(imdb_dir, cache)
    flip_labels_and_digest(path)  # a poisoned cache whose digest agrees with it
    give(path, other)
    cache.chmod(0o1777)
    line = refused(run_flags(imdb_dir, cache, tmp_path / "run"), capfd)
    assert f"refused the token cache {path}: it is fastpt-other's, not yours" in line
    assert f"FASTPT_TRUST_DIRS={cache}" in line and "nothing was trained on it" in line
    assert not (tmp_path / "run").exists()


def test_a_team_cache_is_used_where_the_user_trusts_its_folder(other, imdb_dir, tmp_path, monkeypatch, capfd):
    cache = tmp_path / "cache"
    give(imdb_cache(imdb_dir, cache), other)  # a teammate built it
    monkeypatch.setenv("FASTPT_TRUST_DIRS", str(cache))
    assert main(run_flags(imdb_dir, cache, tmp_path / "run")) == 0


def test_a_cache_of_yours_that_others_can_change_is_refused_with_the_fix(imdb_dir, tmp_path, capfd):
    cache = tmp_path / "cache"
    path = imdb_cache(imdb_dir, cache)
    (path / "train").chmod(0o777)
    line = refused(run_flags(imdb_dir, cache, tmp_path / "run"), capfd)
    assert f"refused the token cache {path}: train can be changed by others (drwxrwxrwx)" in line
    assert f"chmod -R go-w {path}" in line


@pytest.mark.timeout(120)  # before the fix a FIFO hung the run, /dev/zero filled its memory
@pytest.mark.parametrize("planted", ["fifo", "link to /dev/zero"])
def test_a_cache_file_that_is_not_a_regular_file_is_refused_without_hanging(planted, imdb_dir, tmp_path, capfd):
    cache = tmp_path / "cache"
    path = imdb_cache(imdb_dir, cache)
    (path / shared_cache.DIGEST).unlink()
    if planted == "fifo":
        os.mkfifo(path / shared_cache.DIGEST)
    else:
        (path / shared_cache.DIGEST).symlink_to("/dev/zero")
    line = refused(run_flags(imdb_dir, cache, tmp_path / "run"), capfd)
    kind = "a FIFO (named pipe)" if planted == "fifo" else "a symbolic link"
    assert f"refused the token cache {path}: {shared_cache.DIGEST} is {kind}" in line


@pytest.mark.timeout(120)  # before the fix the run waited until killed
@pytest.mark.parametrize("data", ["fifo", "/dev/zero", "link to /dev/zero"])
def test_data_that_is_not_a_regular_file_is_one_line_not_a_hang(data, tmp_path, capfd):
    if data == "fifo":
        source = tmp_path / "reviews.csv"
        os.mkfifo(source)
    elif data == "/dev/zero":
        source = Path("/dev/zero")
    else:
        source = tmp_path / "reviews.csv"
        source.symlink_to("/dev/zero")
    line = refused(["--model", "tiny", "--data", str(source), "--cache-dir", str(tmp_path / "cache"),
                    "--no-progress", "--out", str(tmp_path / "run")], capfd)
    kind = "a FIFO (named pipe)" if data == "fifo" else "a character device"
    assert f"--data {os.path.realpath(source)} is {kind}, not a file or folder" in line
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


# ---------------------------------------------------------------------------- 5. a lock held by someone else

def lock_of(imdb_dir, cache: Path) -> Path:
    key = token_cache.cache_key(imdb.find_source(str(imdb_dir)), load_tokenizer("tiny"))
    return cache / f"imdb-{key}.lock"  # computable in advance by anyone: the key is the data's and tokenizer's


@pytest.mark.timeout(120)  # before the fix the run waited until killed
def test_a_lock_another_user_holds_is_refused_at_once(other, shared, imdb_dir, tmp_path, capfd):
    uid, gid, _ = other
    if shutil.which("flock") is None:
        pytest.skip("needs util-linux's flock command")
    lock = lock_of(imdb_dir, shared)
    # util-linux's flock as the other user: it takes the lock (creating the file), then runs a command that says
    # so and waits for its input to end; -o: the lock stays with flock itself, whose pid /proc/locks shows.
    holder = subprocess.Popen(["flock", "-o", str(lock), "sh", "-c", "echo held; exec cat"], user=uid, group=gid,
                              extra_groups=[], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = refused(run_flags(imdb_dir, shared, tmp_path / "run"), capfd)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert f"the token cache's lock {lock} is held by process {holder.pid} of user fastpt-other" in line
    assert "FASTPT_TRUST_DIRS=" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)  # before the fix the run waited until killed
def test_a_lock_whose_holder_shows_no_progress_is_given_up_with_one_line(imdb_dir, tmp_path, monkeypatch, capfd):
    cache = tmp_path / "cache"
    lock = lock_of(imdb_dir, cache)
    cache.mkdir()
    held = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o600)  # a run of the user's own that hangs while building
    try:
        import fcntl
        fcntl.flock(held, fcntl.LOCK_EX)
        monkeypatch.setenv("FASTPT_LOCK_WAIT", "1")
        capfd.readouterr()
        assert main(run_flags(imdb_dir, cache, tmp_path / "run")) == 2
    finally:
        os.close(held)
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert err[0].startswith(f"waiting for {lock}: process {os.getpid()} of user {pwd.getpwuid(os.getuid()).pw_name} "
                             f"holds it") and "FASTPT_LOCK_WAIT" in err[0]
    assert err[1].startswith(f"error: gave up waiting for {lock}: process {os.getpid()}") and "1 s" in err[1]
    assert not (tmp_path / "run").exists()


class FakeClock:
    """time.monotonic and time.sleep for cache_lock: each sleep moves the clock and lets the holder act."""

    def __init__(self, holder_step):
        self.now, self.holder_step, self.sleeps = 0.0, holder_step, 0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds
        self.sleeps += 1
        self.holder_step(self.sleeps)


def test_a_holder_that_shows_progress_is_waited_for_past_the_limit(tmp_path, monkeypatch, capsys):
    import fcntl
    import types

    lock = tmp_path / "data-key.lock"
    held = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    done = {}

    def builder(sleeps):  # touches its lock every other second, for 20 s, then finishes
        if sleeps % 2 == 0:
            os.utime(lock, ns=(sleeps * 10**9, sleeps * 10**9))
        if sleeps == 20:
            done["at"] = sleeps
            os.close(held)

    clock = FakeClock(builder)
    monkeypatch.setattr(cache_lock, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    monkeypatch.setenv("FASTPT_LOCK_WAIT", "5")
    fd = cache_lock.take_lock(lock)
    os.close(fd)
    assert done == {"at": 20} and clock.now >= 20 > 5
    assert capsys.readouterr().err.count("waiting for") == 1


def test_a_builder_touches_its_lock_while_it_builds(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_lock, "HEARTBEAT_S", 0.05)
    target = tmp_path / "cache" / "data-key"
    lock = target.with_name("data-key.lock")
    seen = []

    def build():
        import time

        os.utime(lock, ns=(0, 0))  # an old time: the heartbeat must move it on
        for _ in range(600):  # up to 30 s on a loaded machine
            seen.append(lock.stat().st_mtime_ns)
            if seen[-1] != 0:
                return
            time.sleep(0.05)

    shared_cache.build_once(target, build)
    assert seen and seen[-1] != 0, "the lock's time never moved while building"
