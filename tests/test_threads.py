"""The thread policy (`glm5lab.threads`): decisions from hand-given CPU and load figures, the
--threads flag, and, in subprocesses, that the CLI sets OMP_NUM_THREADS before torch is imported
and prints its notice only under (faked: GLM5LAB_BUSY_CPUS) load."""

import argparse
import os
import subprocess
import sys

import pytest

from glm5lab.cli import build_parser
from glm5lab.threads import BUSY_ENV, COMPUTE_COMMANDS, choose_threads, configure, parse_threads, usable_cpus


@pytest.mark.parametrize("requested, env, cpus, busy, expected", [
    (None, {}, 2, 0.0, (2, "load")),  # quiet: one thread per CPU
    (None, {}, 2, None, (2, "load")),  # /proc/stat unreadable: taken as quiet
    (None, {}, 2, 0.4, (2, "load")),  # under half a CPU busy: not counted
    (None, {}, 2, 1.0, (1, "load")),  # one busy process on 2 CPUs: 1 thread (docs/threads.md)
    (None, {}, 2, 3.7, (1, "load")),  # never below 1
    (None, {}, 16, 2.6, (13, "load")),
    (None, {"OMP_NUM_THREADS": "2"}, 2, 1.0, (None, "OMP_NUM_THREADS")),  # the user's setting is kept
    (1, {"OMP_NUM_THREADS": "2"}, 2, 0.0, (1, "--threads")),  # --threads wins over it
    (2, {}, 2, 1.0, (2, "--threads")),  # and over the load
    (None, {"LOCAL_WORLD_SIZE": "2"}, 2, 1.0, (1, "2 processes per node")),
    (None, {"LOCAL_WORLD_SIZE": "4"}, 16, 0.0, (4, "4 processes per node")),
    (None, {"LOCAL_WORLD_SIZE": "4"}, 2, 0.0, (1, "4 processes per node")),
    (None, {"OMP_NUM_THREADS": "abc"}, 2, 1.0, (1, "load")),  # invalid (libgomp ignores it): the policy decides
    (None, {"OMP_NUM_THREADS": "0"}, 2, 0.0, (2, "load")),
    (None, {"LOCAL_WORLD_SIZE": "x"}, 2, 0.0, (2, "load")),
])
def test_choose_threads(requested, env, cpus, busy, expected):
    assert choose_threads(requested=requested, env=env, cpus=cpus, busy=busy) == expected


def test_parse_threads_accepts_1_to_cpus_and_names_the_range_otherwise():
    assert parse_threads("1", cpus=2) == 1 and parse_threads("2", cpus=2) == 2
    for bad in ("0", "-1", "3", "1.5", "two", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"'{bad}' is not allowed: a whole number from 1 to 2"):
            parse_threads(bad, cpus=2)


REQUIRED = {"train": [], "generate": ["--model", "m", "--prompt", "x"], "ablate": ["mla"], "report": ["run"],
            "eval": ["perplexity", "run", "text"]}


@pytest.mark.parametrize("command", COMPUTE_COMMANDS)
def test_every_compute_command_takes_threads(command):
    args = build_parser().parse_args([command, *REQUIRED[command], "--threads", "1"])
    assert args.threads == 1
    assert build_parser().parse_args([command, *REQUIRED[command]]).threads is None


def test_bad_threads_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", "--threads", "0"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"glm5lab train: error: argument --threads: '0' is not allowed: a whole number from 1 to "
                    f"{usable_cpus()} (this machine's usable CPUs)")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ledger", "--threads", "1"])  # not a compute command


def test_configure_after_torch_is_imported_changes_only_what_is_asked(monkeypatch):
    import torch

    before = torch.get_num_threads()
    assert configure("generate", None) is None and torch.get_num_threads() == before
    try:
        assert configure("generate", 1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


PROBE = ("import sys, glm5lab.cli; glm5lab.cli.main(sys.argv[1:]); import os, torch; "
         "print(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads())")


def probe(*args: str, **env: str) -> tuple[str, str]:
    """(stdout, stderr) of main(args) in a fresh process, then torch's thread count: `generate` with a
    missing model fails at once (exit 2), after the policy ran and the command imported torch."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", BUSY_ENV, "LOCAL_WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-c", PROBE, "generate", "--model", "/nonexistent", "--prompt", "x", *args],
                       env={**base, **env}, capture_output=True, text=True, timeout=60)
    return r.stdout.strip(), r.stderr


def test_cli_sets_threads_before_torch_and_notices_load_once():
    cpus = usable_cpus()
    out, err = probe(**{BUSY_ENV: "1.0"})  # one busy CPU
    expected = max(1, cpus - 1)
    assert out == f"{expected} {expected}"
    notices = [line for line in err.splitlines() if "other processes keep" in line]
    if cpus > 1:
        assert notices == [f"glm5lab generate: other processes keep 1.0 of {cpus} CPUs busy; using {expected} torch "
                           f"thread{'s' if expected > 1 else ''} (OpenMP threads spin-wait when one is descheduled: "
                           "docs/threads.md); override with --threads N"]
    out, err = probe(**{BUSY_ENV: "0"})
    assert out == f"{cpus} {cpus}" and "other processes keep" not in err
    out, err = probe("--threads", "1", OMP_NUM_THREADS=str(cpus), **{BUSY_ENV: "1.0"})  # --threads wins, no notice
    assert out == "1 1" and "other processes keep" not in err


@pytest.mark.parametrize("value", ["garbage", "nan", "inf", "-1"])
def test_a_bad_busy_cpus_value_is_refused_naming_it(value, monkeypatch):
    from glm5lab.threads import busy_cpus

    monkeypatch.setenv(BUSY_ENV, value)
    with pytest.raises(ValueError, match=f"{BUSY_ENV}={value!r} is not allowed: a number of busy CPUs >= 0"):
        busy_cpus(2)


def test_a_bad_busy_cpus_value_is_one_error_line_from_the_cli():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {BUSY_ENV: "garbage"}
    r = subprocess.run([sys.executable, "-m", "glm5lab", "report", "/no/such/run"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == (f"glm5lab report: error: {BUSY_ENV}='garbage' is not allowed: a number "
                                              "of busy CPUs >= 0 (e.g. 1.0), or unset it\n"), r.stderr
