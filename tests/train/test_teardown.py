"""How a multi-process run leaves its process group (issue 36, faults 9 and 10), one way for the library and the
tests (`glm5lab.parallel.dist`): `session` tears the group down when its block ends (a barrier first when it ends
normally; at once after Ctrl-C or an error), and a process that ends with its run leaves through `end_process`
(atexit handlers and flushed output, then no interpreter teardown, where gloo's threads of the destroyed but still
referenced groups used to abort a rank now and then: "terminate called without an active exception", exit -6).
Every multi-process driver in tests/ goes that way."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

SESSION = """
import os, sys, torch.distributed as dist
from glm5lab.parallel.dist import session
store = dist.HashStore()
for how in ("normal", "ctrl-c", "error"):
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with session():
            if how == "ctrl-c":
                raise KeyboardInterrupt
            if how == "error":
                raise ValueError(how)
    except (KeyboardInterrupt, ValueError):
        pass
    print(how, dist.is_initialized())
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120)


def test_a_session_tears_the_group_down_however_it_ends():
    """Normally (with a barrier), after Ctrl-C and after an error (gloo: destroying cannot block) the group is gone
    when the block ends: no rank reaches the interpreter's exit with its group alive after Ctrl-C."""
    done = _python(SESSION)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:3] == ["normal False", "ctrl-c False", "error False"]


END = """
import atexit, sys
from glm5lab.parallel.dist import end_process
class Finalized:
    def __del__(self, write=sys.stdout.write):
        write("finalized\\n")
kept = Finalized()
atexit.register(lambda: print("atexit ran"))
print("buffered", end=" ")  # stdout is a pipe here: block-buffered, flushed by end_process
end_process(int(sys.argv[1]))
print("not reached")
"""


@pytest.mark.parametrize("status", [0, 3])
def test_end_process_runs_atexit_flushes_and_skips_the_interpreter_teardown(status):
    done = _python(END, str(status))
    assert done.returncode == status, done.stderr[-2000:]
    assert done.stdout == "buffered atexit ran\n"  # no "finalized": module objects are not torn down


def test_every_multiprocess_driver_leaves_through_the_shared_teardown():
    """A driver that joins a process group (init_process_group, dist.setup, or train() under torchrun) tears it down
    through `glm5lab.parallel.dist` (`session`/`teardown`, or train's own session) and ends with `end_process`: no copy
    of the teardown, and no driver left to the interpreter's exit (the flaky 4-process fixture of
    tests/optim/test_muon_dist.py ended with a bare destroy_process_group)."""
    tests = Path(__file__).resolve().parents[1]
    checked = []
    for path in sorted(tests.rglob("*.py")):
        text = path.read_text()
        if path.name == Path(__file__).name:
            continue
        for driver in _drivers(text):
            joins = re.search(r"init_process_group|dist\.setup\(\)|\btrain\(TrainArgs", driver)
            if not joins:
                continue
            checked.append(path.name)
            assert "destroy_process_group" not in driver, path  # one teardown, the library's
            assert re.search(r"\bsession\(|teardown\(|\btrain\(TrainArgs", driver), path
            assert "end_process(" in driver, path
    assert {"muon_dist_driver.py", "test_expert_parallel.py", "test_fsdp.py", "test_precision.py",
            "test_grad_accum.py", "test_scale_torchrun.py", "test_sharded_checkpoint.py"} <= set(checked)


def _drivers(text: str) -> list[str]:
    """The code that runs in the spawned processes of a test file: its DRIVER strings, its `worker` functions for
    torch.multiprocessing, and the file itself when it is a torchrun script (`__main__`)."""
    found = re.findall(r'DRIVER = """(.*?)"""', text, flags=re.S)
    found += re.findall(r"\ndef (?:_\w*)?worker\(.*?(?=\n\S)", text, flags=re.S)
    if '__name__ == "__main__"' in text:
        found.append(text)
    return found


def test_ctrl_c_under_torchrun_stops_every_rank_once_and_cleanly(tmp_path):
    """Ctrl-C reaches torchrun, which sends SIGINT on to every rank: each leaves its group at once and ends through
    `end_process`; rank 0 says where the run stands, once; no rank aborts ("terminate called without an active
    exception"), and the run's lock file is gone with it."""
    import signal
    import time

    from tests.conftest import write_word_corpus

    write_word_corpus(tmp_path / "texts")
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLM5LAB_CACHE": str(tmp_path / "cache")}
    with (tmp_path / "err.txt").open("w") as err:
        launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                     f"--master_port={free_port()}", "-m", "glm5lab", "train", "--recipe", "tiny",
                                     "--data", str(tmp_path / "texts"), "--steps", "60", "--threads", "1",
                                     "--no-progress", "--out", str(run)], env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 600
            while not ((run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2):
                assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
                time.sleep(0.2)
            launcher.send_signal(signal.SIGINT)
            launcher.wait(timeout=120)
        finally:
            launcher.kill()
    text = (tmp_path / "err.txt").read_text()
    assert "terminate called" not in text, text[-3000:]
    assert text.count("glm5lab train: interrupted") == 1, text[-3000:]
    assert not (run / "run.lock").exists()


def test_sigterm_ends_a_one_process_run_as_ctrl_c_does(tmp_path):
    """SIGTERM (`timeout`, a scheduler's preemption) killed a one-process run where it stood, leaving run.lock behind
    (issue 36). Now it ends the run as Ctrl-C does: the latest checkpoint kept, the lock file removed, one line
    saying so, exit status 143 (128 + SIGTERM)."""
    import json
    import signal
    import time

    from tests.conftest import write_word_corpus
    from glm5lab.config import ModelConfig

    write_word_corpus(tmp_path / "texts")
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig.from_preset("tiny", vocab_size=320).to_hf()))
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1", "GLM5LAB_CACHE": str(tmp_path / "cache")}
    env.pop("TORCHELASTIC_RUN_ID", None)
    proc = subprocess.Popen([sys.executable, "-m", "glm5lab", "train", "--config", str(tmp_path / "config.json"),
                             "--data", str(tmp_path / "texts"), "--steps", "300", "--seq-len", "24", "--batch-size", "2",
                             "--checkpoint-every", "2", "--eval-every", "0", "--threads", "1", "--no-progress",
                             "--out", str(run)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "latest").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert err.splitlines()[-1] == (f"glm5lab train: stopped (SIGTERM); the latest checkpoint in {run} is kept: "
                                    "continue with the same arguments plus --resume"), err[-3000:]
    assert not (run / "run.lock").exists()
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert (latest / "trainer_state.json").is_file()


@pytest.mark.parametrize("where", ["save", "load"])
def test_a_stop_inside_a_checkpoint_save_or_load_stops_the_run(tiny_model, tmp_path, monkeypatch, where):
    """DCP catches BaseException inside its collectives and wraps it in a CheckpointException: a SIGTERM (`Stopped`)
    landing inside a save failed the run with a traceback instead of exit 143 (seen once in CI), and one inside a load
    read as a corrupt checkpoint. `glm5lab.checkpoints.dcp.raise_interrupt` gives the stop back, and a stopped save
    leaves no temp folder."""
    import torch
    from torch.distributed.checkpoint import default_planner

    from glm5lab.checkpoints.dcp import load, save
    from glm5lab.cli import Stopped

    folder = tmp_path / "step-000001"
    state = {"position": {"step": 1, "stage": 0, "in_stage": 1}, "ep": 1}
    if where == "load":
        save(folder, tiny_model, torch.optim.AdamW(tiny_model.parameters()), state)

    def stop(self, *args, **kwargs):
        raise Stopped("stopped (SIGTERM)")

    planner = default_planner.DefaultSavePlanner if where == "save" else default_planner.DefaultLoadPlanner
    monkeypatch.setattr(planner, "create_local_plan", stop)
    with pytest.raises(Stopped):
        if where == "save":
            save(folder, tiny_model, torch.optim.AdamW(tiny_model.parameters()), state)
        else:
            load(folder, tiny_model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if where == "save" else ["step-000001"])
