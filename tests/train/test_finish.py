"""A run stopped between its last training step and summary.json (issue 24): at every point of
the final save (the model files, the trainer state, the rename into place, the `latest` pointer,
the pruning of older checkpoints) and of the finish (the final evaluation, loss.png, the export to
RUN/model, the summary write), `--resume` does what is left and ends exactly as the uninterrupted run: the same
metrics.jsonl losses, the same summary.json (the subset's final figure restored from
metrics.jsonl), the same final weights bit for bit, the same checkpoint folders, a loss.png."""

import json
import shutil

import pytest
import torch

import torch.distributed.checkpoint as torch_dcp

import glm5lab.checkpoints.dcp as dcp_module
import glm5lab.checkpoints.folder as checkpoint_module
import glm5lab.train.loop as loop_module
import glm5lab.train.plot as plot_module
from glm5lab import GLM5ForCausalLM
from glm5lab.train.loop import train
from tests.train.conftest import metrics_rows, run_args

FINAL = "step-000009"
KEYS = ("loss", "lm_loss", "mtp_losses", "indexer_kl", "grad_norm", "val_loss", "val_tokens", "expert_load",
        "tokens", "step", "stage", "stage_step", "lr")


def _kill_at(point: str, monkeypatch) -> None:
    """Make the run raise KeyboardInterrupt (Ctrl-C) at `point` of the final save or the finish."""
    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    def when(condition, real):
        return lambda *a, **kw: stop() if condition(*a, **kw) else real(*a, **kw)

    final_tmp = lambda path, *a, **kw: f".{FINAL}.tmp" in str(path)  # noqa: E731
    if point == "model files":
        monkeypatch.setattr(torch_dcp, "save", when(lambda state, **kw: final_tmp(kw["checkpoint_id"]), torch_dcp.save))
    elif point == "trainer state":
        monkeypatch.setattr(dcp_module, "atomic_write_text", when(final_tmp, dcp_module.atomic_write_text))
    elif point == "latest pointer":  # the folder is renamed into place, `latest` still names step 6
        monkeypatch.setattr(checkpoint_module, "atomic_write_text",
                            when(lambda path, text: FINAL in text, checkpoint_module.atomic_write_text))
    elif point == "pruning":  # `latest` names step 9; the older folder is half deleted
        def half_prune(run_dir, keep=2):
            victim = sorted((run_dir / "checkpoints").glob("step-*"))[0]
            if (run_dir / "checkpoints" / "latest").read_text().strip() == FINAL and victim.name != FINAL:
                (victim / "__0_0.distcp").unlink()
                stop()
            real_prune(run_dir, keep=keep)
        real_prune = checkpoint_module.prune_checkpoints
        monkeypatch.setattr(checkpoint_module, "prune_checkpoints", half_prune)
    elif point == "final evaluation":
        monkeypatch.setattr(loop_module, "evaluate_nll",
                            when(lambda *a, **kw: a[3] is None, loop_module.evaluate_nll))
    elif point == "loss.png":
        def half_plot(metrics, out, summary):
            out.write_bytes(b"\x89PNG half")
            stop()
        monkeypatch.setattr(plot_module, "plot_losses", half_plot)
    elif point == "model folder":  # RUN/model half written
        def half_export(folder, out, **kw):
            out.mkdir()
            (out / "config.json").write_text("{")
            stop()
        monkeypatch.setattr(loop_module, "export_checkpoint", half_export)
    elif point == "summary":
        monkeypatch.setattr(loop_module, "atomic_write_text",
                            when(lambda path, text: path.name == "summary.json", loop_module.atomic_write_text))
    else:
        raise AssertionError(point)


def _state(run):
    return GLM5ForCausalLM.from_pretrained(run / "checkpoints" / FINAL).state_dict()


@pytest.mark.parametrize("point", ["model files", "trainer state", "latest pointer", "pruning", "final evaluation",
                                   "loss.png", "model folder", "summary"])
def test_a_run_stopped_before_its_summary_is_finished_by_resume_bit_identically(corpus, monkeypatch, capsys,
                                                                                 point):
    full, killed = corpus / "full", corpus / "killed"
    train(run_args(corpus, full))
    with monkeypatch.context() as m:
        _kill_at(point, m)
        with pytest.raises(KeyboardInterrupt):
            train(run_args(corpus, killed))
    assert not (killed / "summary.json").exists()
    with pytest.raises(FileExistsError, match="continue it with --resume"):  # a fresh start is still refused
        train(run_args(corpus, killed))
    capsys.readouterr()
    summary = train(run_args(corpus, killed, resume=True))
    if point in ("final evaluation", "loss.png", "model folder", "summary", "pruning"):  # nothing left to train
        assert "training ended at step 9 of 9; what is left: the final evaluation" in capsys.readouterr().err
    expected = json.loads((full / "summary.json").read_text())
    assert json.loads((killed / "summary.json").read_text()) == {**expected, "run_dir": str(killed)}
    assert summary == {**expected, "run_dir": str(killed)}
    picked = lambda run: [[r.get(k) for k in KEYS] for r in metrics_rows(run)]  # noqa: E731
    assert picked(killed) == picked(full)
    a, b = _state(full), _state(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    served = GLM5ForCausalLM.from_pretrained(killed / "model").state_dict()  # the HF folder: the same weights
    assert served.keys() == a.keys() and all(torch.equal(a[k], served[k]) for k in a)
    listing = lambda run: sorted(p.name for p in (run / "checkpoints").iterdir())  # noqa: E731
    assert listing(killed) == listing(full)
    assert (killed / "loss.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="already complete"):
        train(run_args(corpus, killed, resume=True))


def test_the_subset_figure_of_a_run_finished_by_resume_comes_from_metrics(corpus, monkeypatch):
    """The periodic validation's last figure is what metrics.jsonl logged at the last step, even
    when the process that finishes the run never ran a validation itself."""
    killed = corpus / "killed"
    with monkeypatch.context() as m:
        _kill_at("final evaluation", m)
        with pytest.raises(KeyboardInterrupt):
            train(run_args(corpus, killed))
    last = [r for r in metrics_rows(killed) if r.get("val_loss") is not None][-1]
    shutil.copy(killed / "metrics.jsonl", corpus / "metrics.before")
    summary = train(run_args(corpus, killed, resume=True))
    assert (summary["val_subset_loss"], summary["val_subset_tokens"]) == (last["val_loss"], last["val_tokens"])
    assert (killed / "metrics.jsonl").read_text() == (corpus / "metrics.before").read_text()


def test_a_plot_that_fails_is_one_notice_and_the_summary_is_still_written(corpus, monkeypatch, capsys):
    """loss.png is drawn before summary.json: a plotting error (issue 36: two runs in one folder repeated steps, and
    matplotlib refused the curve) must not turn the trained run into a failed one."""
    def broken(metrics, out, summary):
        raise ValueError("x and y must have same first dimension,\nbut have shapes (102,) and (72,)")

    monkeypatch.setattr(plot_module, "plot_losses", broken)
    run = corpus / "run"
    summary = train(run_args(corpus, run))
    assert json.loads((run / "summary.json").read_text()) == summary and summary["steps"] == 9
    assert not (run / "loss.png").exists()
    err = [line for line in capsys.readouterr().err.splitlines() if "loss.png" in line]
    assert err == ["glm5lab train: warning: loss.png not drawn (ValueError: x and y must have same first dimension, "
                   "but have shapes (102,) and (72,)); the run is complete, its summary.json follows"]


def test_loss_png_draws_the_whole_split_figure_of_the_summary(corpus, monkeypatch):
    """loss.png is drawn before summary.json is written: the whole-split diamond comes from the summary the run
    passes, not from a file that does not exist yet."""
    seen = []

    def spy(ax, rows, summary, **kw):
        seen.append(summary)
        return real(ax, rows, summary, **kw)

    real = plot_module.draw_losses
    monkeypatch.setattr(plot_module, "draw_losses", spy)
    summary = train(run_args(corpus, corpus / "run"))
    assert [s["val_loss"] for s in seen] == [summary["val_loss"]]
