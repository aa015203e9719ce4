"""One run at a time in a run folder (issue 36, fault 1): a second `glm5lab train` (fresh or --resume) into a folder
another run holds is refused in one line naming the holder, and leaves the folder as it was; a lock whose holder was
killed does not block; under torchrun every rank holds the folder, and killing the launcher (SIGKILL) stops its
ranks, which frees it, also during their start-up or before it."""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from glm5lab.cli import main
from glm5lab.train.loop import train
from glm5lab.train.run_lock import LOCK_FILE, RunFolderInUse, hold_run_folder
from tests.conftest import free_port
from tests.train.conftest import run_args, tiny_plan

ONE = SimpleNamespace(is_main=True, world_size=1, rank=0)
"""A one-process run's `DistContext`, as `hold_run_folder` reads it."""

HOLDER = """
import sys, time
from pathlib import Path
from types import SimpleNamespace
from glm5lab.train.run_lock import hold_run_folder
with hold_run_folder(Path(sys.argv[1]), SimpleNamespace(is_main=True, world_size=1, rank=0)):
    print("holding", flush=True)
    time.sleep(600)
"""


def _hold_in_subprocess(run: Path) -> subprocess.Popen:
    """Another process holding `run` (as a run does), once it says so."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline() == "holding\n"
    return proc


def _listing(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_start_into_a_held_folder_is_refused_naming_the_holder(corpus, capsys):
    run = corpus / "run"
    train(dataclasses.replace(run_args(corpus, run), stage_plan=tiny_plan()[:1]))  # a run there to --resume: 4 steps
    capsys.readouterr()  # that run's own lines (the corpus tokenized into the cache)
    holder = _hold_in_subprocess(run)
    try:
        before = _listing(run)
        info = json.loads((run / LOCK_FILE).read_text())
        assert info["pid"] == holder.pid and info["command"].endswith(str(run)) and info["host"] and info["started"]
        for extra in ([], ["--resume"], ["--resume", "--steps", "6"], ["--dry-run"], ["--resume", "--dry-run"]):
            assert main(["train", "--config", str(corpus / "config.json"), "--data", str(corpus / "texts"),
                         "--out", str(run), "--no-progress", *extra]) == 2
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1, err
            assert err[0].startswith(f"glm5lab train: error: --out {run} is in use by another run (pid {holder.pid} "
                                     f"on {info['host']}, started {info['started']}: ")
            assert f"stop it (kill {holder.pid} on {info['host']})" in err[0]
            assert _listing(run) == before  # refused before anything was read or written
        with pytest.raises(RunFolderInUse):  # also from the library
            train(run_args(corpus, run, resume=True))
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_killed_run_does_not_block(tmp_path):
    run = tmp_path / "run"
    holder = _hold_in_subprocess(run)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == holder.pid  # left behind, unlocked
    with hold_run_folder(run, ONE):
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(RunFolderInUse, match=f"pid {os.getpid()} on"):  # held: a second hold is refused
            with hold_run_folder(run, ONE):
                pass
    assert list(run.iterdir()) == []  # the stale lock file is gone with the lock (the folder was the killed run's)


def test_a_failed_start_removes_only_what_the_lock_made(tmp_path):
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    for run, left in ((tmp_path / "new" / "run", False), (kept, True)):
        with pytest.raises(KeyboardInterrupt):
            with hold_run_folder(run, ONE):
                raise KeyboardInterrupt
        assert run.exists() == left and not (tmp_path / "new").exists()
    assert _listing(kept) == {"notes.txt": b"mine"}


DRIVER = """
import os, sys, time
from pathlib import Path
from glm5lab.parallel import dist
from glm5lab.train.run_lock import hold_run_folder
ctx = dist.setup()
with dist.session(ctx), hold_run_folder(Path(sys.argv[1]), ctx):
    Path(sys.argv[2], f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)  # until the test kills the launcher
dist.end_process()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie's main thread has ended (its other threads may still be ending)


def _flock_holders(path: Path) -> set[tuple[int, str]]:
    """(pid, READ or WRITE) of each flock on `path`, from /proc/locks (none when there is no such file)."""
    if not path.exists():
        return set()
    inode = os.stat(path).st_ino
    rows = [line.split() for line in Path("/proc/locks").read_text().splitlines()]
    return {(int(r[4]), r[3]) for r in rows if r[1] == "FLOCK" and int(r[5].rsplit(":", 1)[1]) == inode}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killing_the_torchrun_launcher_stops_its_ranks_and_frees_the_folder(tmp_path):
    """torchrun starts each rank in a session of its own, so SIGKILL of the launcher reached none of them, and they
    trained on holding the folder: now each rank exits with its launcher (`launcher.exit_with_launcher`). While they
    run, every rank holds the folder: a start is refused naming torchrun and rank 0."""
    run, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                 f"--master_port={free_port()}", str(tmp_path / "driver.py"), str(run), str(pids)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = []
    try:
        deadline = time.monotonic() + 240
        while len(ranks) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
            time.sleep(0.2)
            ranks = [int(p.read_text()) for p in sorted(pids.glob("rank*.pid")) if p.read_text()]
        with pytest.raises(RunFolderInUse, match=f"torchrun pid {launcher.pid} with 2 processes, rank 0 pid "
                                                 f"{ranks[0]} on .* stop it \\(kill {launcher.pid} on "):
            with hold_run_folder(run, ONE):
                pass
        assert _flock_holders(run / LOCK_FILE) == {(pid, "READ") for pid in ranks}  # every rank, shared
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 60
        while (any(_alive(pid) for pid in ranks) or _flock_holders(run / LOCK_FILE)) and time.monotonic() < deadline:
            time.sleep(0.1)  # a rank's main thread ends first (state Z); its files close with its last thread
        assert not any(_alive(pid) for pid in ranks), "the ranks outlived their launcher"
        with hold_run_folder(run, ONE):  # free again
            pass
    finally:
        launcher.kill()
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_launcher_is_gone_when_its_store_refuses_connections(monkeypatch):
    """`launcher_gone` asks the store torchrun's agent holds for the whole run: refused = the launcher is dead; a
    listening store, or no agent store (the ranks make their own), decides nothing."""
    from glm5lab.parallel.launcher import launcher_gone

    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        port = store.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        assert launcher_gone()  # bound, not listening: refused
        store.listen()
        assert not launcher_gone()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert not launcher_gone()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_end_with_a_launcher_killed_during_their_start(tmp_path, corpus):
    """SIGKILL of torchrun while its ranks start (issue 36: 2.5 s in, both ranks retried its store for 30 minutes):
    rank 1 is in its checks (importing torch: tied to the launcher since `main` began), rank 0 has not even started
    Python (the launcher is dead before it could tie itself: it finds the launcher's store gone). Both end."""

    pids = tmp_path / "pids"
    pids.mkdir()
    train = (f"exec {sys.executable} -m glm5lab train --config {corpus / 'config.json'} --data {corpus / 'texts'} "
             f"--steps 30 --no-progress --threads 1 --out {tmp_path / 'run'}")
    # torchrun reads its arguments as string.Template macros, where $$ stands for $: the shell gets `echo $$`
    script = f'echo $$$$ > {pids}/rank$RANK.pid; [ "$RANK" = 0 ] && sleep 4; {train}'
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                 f"--master_port={free_port()}", "--no-python", "sh", "-c", script],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = []
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "the ranks did not start"
            time.sleep(0.1)
            ranks = [int(p.read_text()) for p in sorted(pids.glob("rank*.pid")) if p.read_text().strip()]
        time.sleep(1.0)  # rank 1 in its start-up, rank 0 still in `sleep`
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in ranks), "ranks outlived a launcher killed during their start"
    finally:
        launcher.kill()
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
