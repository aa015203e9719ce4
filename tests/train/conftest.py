"""What the training-run tests share: the `corpus` fixture (a word corpus and a tiny model config), the 9-step
three-stage plan and its `TrainArgs`, a run's metrics rows, and a run killed at a step."""

import json

import pytest

from glm5lab import ModelConfig
from glm5lab.train.loop import TrainArgs, _Loop, train
from glm5lab.train.stages import Stage
from tests.conftest import write_word_corpus


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """tmp_path holding texts/ (`write_word_corpus`) and config.json (the tiny preset at vocab 320), with its own
    tokenizer cache (GLM5LAB_CACHE)."""
    monkeypatch.setenv("GLM5LAB_CACHE", str(tmp_path / "cache"))
    write_word_corpus(tmp_path / "texts")
    cfg = ModelConfig.from_preset("tiny", vocab_size=320)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    return tmp_path


def tiny_plan(steps=(4, 2, 3), seq_len=24, batch=2) -> list[dict]:
    """The dense, indexer warm-up and sparse stages of `steps` steps each, as a stage plan (`Stage.to_dict`)."""
    return [s.to_dict() for s in (
        Stage("dense", steps[0], 3e-3, seq_len, batch, warmup_steps=min(1, steps[0] - 1)),
        Stage("indexer_warmup", steps[1], 5e-3, seq_len, batch, trainable="indexer", lm_weight=0.0, mtp_weights=(0.0,),
              indexer_weight=1.0),
        Stage("sparse_adaptation", steps[2], 3e-4, seq_len, batch, use_dsa=True, indexer_weight=1.0),
    )]


def run_args(corpus, out, **kw) -> TrainArgs:
    """A 9-step run of `tiny_plan` on the `corpus` fixture's folder into `out`, evaluating and checkpointing every
    3 steps."""
    return TrainArgs(config=str(corpus / "config.json"), data=str(corpus / "texts"), out=str(out), progress=False,
                     eval_every=3, eval_tokens=96, checkpoint_every=3, stage_plan=tiny_plan(), **kw)


def metrics_rows(run) -> list[dict]:
    """The run folder's metrics.jsonl, one dict per line."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def logged_losses(run) -> list[tuple]:
    """(loss, lm_loss, val_loss or None) of each metrics row."""
    return [(r["loss"], r["lm_loss"], r.get("val_loss")) for r in metrics_rows(run)]


def train_killed_at(step: int, args: TrainArgs, monkeypatch) -> None:
    """Run `train(args)` and kill it (KeyboardInterrupt) when the loop reaches `step`."""
    real_batch = _Loop.batch

    def dying_batch(self, index, stage, i):
        if self.step == step:
            raise KeyboardInterrupt
        return real_batch(self, index, stage, i)

    monkeypatch.setattr(_Loop, "batch", dying_batch)
    with pytest.raises(KeyboardInterrupt):
        train(args)
    monkeypatch.setattr(_Loop, "batch", real_batch)
