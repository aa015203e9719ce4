"""One run at a time in a run folder: `hold_run_folder` locks `RUN/run.lock` while a run trains there, so a second
`glm5lab train` into the same folder (a fresh start, a --resume, or any process of another torchrun) is refused in
one line naming the holder, instead of two runs interleaving one metrics.jsonl and one checkpoints/ folder.
`glm5lab ablate` holds its --out the same way for the whole study, so a study and a run, or two studies, never
write one folder at once.

The lock is `fcntl.flock` on the file: the kernel drops it when its holder exits in any way (SIGKILL included), so a
crashed run never leaves its folder locked; what the file holds (pid, host, command, start time, process count) only
names the holder. A start first calls `refuse_if_held` (`glm5lab.train.plan.check_run`, before its checks read the
folder; a --dry-run too), then `hold_run_folder` once its process group is set up. Every process of a run holds the
file, so a folder stays held while any rank of its run is alive: the main rank takes it exclusively (no process of
any run holds it), writes itself into it and turns it into a shared lock, then the other ranks take it shared. A
start needs the exclusive lock, so it is refused while any process of another run holds the file. flock is per open
file, also between two opens in one process; on NFS Linux emulates it with byte-range locks, which reach every host.
The other ranks find the file on a folder every rank sees (as the sharded checkpoints need); on a folder local to
each host only the main rank's host is locked.

When the run ends, however it ends (done, a refusal, an error, Ctrl-C), the main rank removes the lock file and the
folders made for it when they are left empty: a failed start still leaves no folder behind. A killed run leaves the
file, unlocked; its content is then stale and never shown.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

LOCK_FILE = "run.lock"


class RunFolderInUse(ValueError):
    """Another run holds the run folder (a ValueError: `glm5lab train` refuses it in one line, exit status 2)."""


@contextlib.contextmanager
def hold_run_folder(run_dir: Path, ctx=None, *, create: bool = True):
    """Hold `run_dir` (created if missing, with its parents, when `create`; a --resume makes nothing) for the `with`
    block, on every rank of `ctx` (a `glm5lab.parallel.dist.DistContext`: a collective call under torchrun; None: one
    process, as `glm5lab ablate` holds its --out). Raises
    RunFolderInUse, naming the holder, on every rank when another run holds it. A folder that is missing (not
    `create`) or cannot be made (--out is a file, no permission) is left to the run's own checks: nothing is held
    then. On the way out the lock is released, and on the main rank the lock file is removed with the folders made
    for it when they are empty."""
    path = Path(run_dir) / LOCK_FILE
    ctx = ctx or ONE_PROCESS
    fd, made, refusal = None, [], None
    if ctx.is_main:
        try:
            fd, made = _take(path, create)
        except RunFolderInUse as e:
            refusal = str(e)
    refusal = _from_main(refusal, ctx)
    if refusal is not None:
        raise RunFolderInUse(refusal)
    if not ctx.is_main:  # a shared lock on the file its main rank holds (None when this host does not see it)
        fd = _open_locked(path, os.O_RDONLY, fcntl.LOCK_SH)
    try:
        yield
    finally:
        if fd is not None and ctx.is_main:  # removed while still held: a start that opened it meanwhile then finds
            with contextlib.suppress(OSError):  # another file there, or none, and retries (`_take`)
                path.unlink()
            with contextlib.suppress(OSError):  # not empty: the run wrote into it
                for folder in made:  # deepest first
                    folder.rmdir()
        if fd is not None:
            os.close(fd)


ONE_PROCESS = SimpleNamespace(is_main=True, world_size=1, rank=0)
"""A one-process run's place, as `hold_run_folder` reads a `DistContext` (without importing torch)."""


def refuse_if_held(run_dir: Path) -> None:
    """Raise RunFolderInUse, naming the holder, when another run holds `run_dir`; change nothing. A start calls it
    before any of its checks reads the folder, so a second start into a folder a run trains in is told so, rather
    than what that folder's run.json or checkpoints would make it refuse; `hold_run_folder` then takes the lock (a
    start between the two is refused there)."""
    path = Path(run_dir) / LOCK_FILE  # opened read-write: on NFS an exclusive flock is a write lock
    fd = _open_locked(path, os.O_RDWR, fcntl.LOCK_EX, tries=10)
    if fd is not None:  # None: no lock file (no run holds the folder), or not ours to write: `hold_run_folder` decides
        os.close(fd)  # drops the exclusive lock this probe took


def _take(path: Path, create: bool) -> tuple[int | None, list[Path]]:
    """The main rank's side of `hold_run_folder`: lock the file exclusively, write the holder into it, then share it.
    Returns (its descriptor, the folders made for it, deepest first), or (None, []) when its folder is missing (not
    `create`) or cannot be made. Raises RunFolderInUse (having changed nothing: the file and its folder are the
    holder's)."""
    folder, made = path.parent.absolute(), []
    if not (create or folder.is_dir()):
        return None, []
    while True:
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:  # --out is a file, or a folder this process cannot write to: the run's checks refuse it
            return None, []
        fd = _open_locked(path, os.O_RDWR | os.O_CREAT, fcntl.LOCK_EX, tries=10)
        if fd is None:  # a file this process cannot create or write: as above
            return None, []
        made = missing or made
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        os.close(fd)  # removed by the run that held it while this process waited: lock the file there now
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(holder()) + "\n").encode())
    if not _flock(fd, fcntl.LOCK_SH):  # not atomic (flock drops the lock, then takes the new one): a start in
        os.close(fd)  # between wins, this one is refused
        raise RunFolderInUse(_refusal(path))
    return fd, made


def _flock(fd: int, operation: int, tries: int = 1, wait_s: float = 0.1) -> bool:
    """Whether flock(operation) on `fd` succeeds within `tries` attempts `wait_s` apart. An exclusive lock tries for
    about a second: a run holds the file for as long as it runs, while another start's probe (`refuse_if_held`) or
    the main rank's turn from exclusive to shared holds it for microseconds, which must not refuse a start."""
    for i in range(tries):
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if i + 1 < tries:
                time.sleep(wait_s)
    return False


def _open_locked(path: Path, flags: int, operation: int, tries: int = 1) -> int | None:
    """`path` opened with `flags` (a file it creates: mode 0o644) and locked (`_flock`); None when it cannot be
    opened. Raises RunFolderInUse, naming the holder, when another run holds it."""
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        return None
    if not _flock(fd, operation, tries):
        os.close(fd)
        raise RunFolderInUse(_refusal(path))
    return fd


def _from_main(refusal: str | None, ctx) -> str | None:
    """The main rank's refusal (or None), on every rank."""
    if ctx.world_size == 1:
        return refusal
    import torch.distributed as tdist

    box = [refusal]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def holder() -> dict:
    """What the lock file says of this process: pid, host, command line, start time (local, ISO), and under torchrun
    the process count and the launcher's pid (the parent of every rank: stopping it stops the run)."""
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": shlex.join(sys.orig_argv),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if "TORCHELASTIC_RUN_ID" in os.environ:
        info.update(processes=int(os.environ.get("WORLD_SIZE", "1")), launcher_pid=os.getppid())
    return info


def _refusal(path: Path) -> str:
    """The one line refusing a start into the folder of `path`, naming its holder."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):  # being written at this moment, or not ours
        info = {}
    folder = path.parent
    if not {"pid", "host", "command", "started"} <= info.keys():
        who, stop = f"its lock file {path} does not say which yet", "stop it"
    else:
        launcher = info.get("launcher_pid")
        ranks = f"torchrun pid {launcher} with {info.get('processes')} processes, rank 0 " if launcher else ""
        who = f"{ranks}pid {info['pid']} on {info['host']}, started {info['started']}: {info['command']}"
        stop = f"stop it (kill {launcher or info['pid']} on {info['host']})"
    return (f"--out {folder} is in use by another run ({who}); wait for it to end or {stop}, then run again: one run "
            f"at a time writes a run folder (its lock: {path})")
