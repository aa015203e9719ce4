"""`glm5lab train --tensorboard`: the event log in the run folder's tb/ holds the scalars of metrics.jsonl, read
back with tensorboard's own EventAccumulator; a resumed run continues the same log without the steps it trains
again; a missing package is one line naming the install command."""

import builtins

import numpy as np
import pytest

from glm5lab.train.tensorboard import check_available, scalars
from glm5lab.train.loop import train
from tests.train.conftest import metrics_rows, run_args, train_killed_at


def _events(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _expected(rows) -> dict[str, list[tuple[int, float]]]:
    """What the log must hold: each record's `scalars`, float32 as TensorBoard stores them (exact)."""
    out = {}
    for r in rows:
        for tag, value in scalars(r).items():
            out.setdefault(tag, []).append((r["step"], float(np.float32(value))))
    return out


def test_scalars_of_a_record():
    record = {"loss": 2.5, "lm_loss": 2.0, "mtp_losses": [0.5, None], "indexer_kl": None, "lr": 1e-3, "step": 4,
              "stage": "dense", "stage_step": 4, "expert_load": [[1, 3], [2, 2]], "ep_tokens": [5, 7], "grad_norm": 2.0}
    assert scalars(record) == {"loss/dense": 2.5, "lm_loss": 2.0, "mtp_losses/1": 0.5, "lr": 1e-3, "grad_norm/dense": 2.0,
                               "expert_load/max_over_mean/layer0": 1.5, "expert_load/max_over_mean/layer1": 1.0,
                               "expert_load/max_over_mean": 1.5, "ep_tokens/0": 5.0, "ep_tokens/1": 7.0}


def test_event_log_equals_metrics_and_a_resumed_run_continues_it(corpus, monkeypatch):
    run = corpus / "tb-run"
    train_killed_at(7, run_args(corpus, run, tensorboard=True), monkeypatch)  # logged 1..7, checkpoint at 6
    assert max(step for series in _events(run / "tb").values() for step, _ in series) == 7
    summary = train(run_args(corpus, run, tensorboard=True, resume=True))  # trains 7.. again
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == list(range(1, 10))
    got, want = _events(run / "tb"), _expected(rows)
    for tag in ("loss/dense", "loss/indexer_warmup", "loss/sparse_adaptation", "lm_loss", "mtp_losses/1", "indexer_kl",
                "lr", "grad_norm/dense", "grad_norm/indexer_warmup", "tokens_per_s", "step_time_s", "expert_load/max_over_mean", "val_loss"):
        assert tag in got, tag
    final = {f"final/{k}": [(9, float(np.float32(summary[k])))] for k in ("val_loss", "val_perplexity",
                                                                          "val_bits_per_byte")}
    assert got == {**want, **final}  # step 7 once (the resumed run's), every value as metrics.jsonl's


def test_one_tag_per_quantity(corpus):
    """The objective `loss` is the LM + MTP loss in a dense stage and the indexer KL alone in the warm-up (issue 36:
    one `loss` curve went from 11.7 to 6e-5 and back), and `grad_norm` the whole model's in one and the indexer's
    alone in the other (~2 against ~3e-4 under one tag): a tag per stage, each one quantity; the whole split's final
    validation has tags of its own, apart from the periodic subset's `val_loss`."""
    run = corpus / "tb-run"
    summary = train(run_args(corpus, run, tensorboard=True))
    got, rows = _events(run / "tb"), metrics_rows(run)
    assert "loss" not in got and "grad_norm" not in got
    for stage in ("dense", "indexer_warmup", "sparse_adaptation"):
        for key in ("loss", "grad_norm"):
            assert got[f"{key}/{stage}"] == [(r["step"], float(np.float32(r[key]))) for r in rows if r["stage"] == stage]
    assert [v for _, v in got["loss/indexer_warmup"]] == [float(np.float32(r["indexer_kl"])) for r in rows[4:6]]
    assert got["final/val_loss"] == [(9, float(np.float32(summary["val_loss"])))]
    assert got["val_loss"][-1] == (9, float(np.float32(rows[-1]["val_loss"])))  # the subset, not the whole split
    assert summary["val_loss"] != rows[-1]["val_loss"]


def test_missing_package_is_one_line(monkeypatch):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "tensorboard":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ValueError, match=r"^--tensorboard needs the tensorboard package, which is not installed: "
                                         r"pip install tensorboard"):
        check_available()
