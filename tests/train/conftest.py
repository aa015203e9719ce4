"""What the training-run tests share: the `corpus` fixture (a word corpus and a tiny model config), the 9-step
three-stage plan and its `TrainArgs`, a run's metrics rows, a run killed at a step, the one start runs at several
process counts share (`shared_init`), and what a fresh draw must look like (`init_differences`)."""

import json

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
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


def shared_init(root) -> str:
    """The start that runs compared across process counts train from (`TrainArgs(init=)`; a fresh run under torchrun
    draws each rank's shards from its own generator, not one process's values: docs/scaling.md): `torch.manual_seed(0);
    GLM5ForCausalLM(cfg)` of root/config.json saved as the HF folder root/init (once; the global generator is left
    as it was). Returns the folder's path."""
    folder = root / "init"
    if not (folder / "config.json").is_file():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            GLM5ForCausalLM(ModelConfig.from_hf(root / "config.json")).save_pretrained(folder)
    return str(folder)


def init_differences(got: dict, want: dict) -> list[str]:
    """Where the state dict `got` (a fresh draw) is not drawn as the seeded build's `want`: another key set, shape or
    dtype; a tensor constant in `want` (norms, biases, buffers) not equal to it; a random one of >= 256 elements whose
    mean is more than 0.3 of want's std from want's, or whose std is more than 20% off (each about 5 sigma at 256
    elements); a smaller random one (GDN decays: checked by range in test_meta_init.py) constant or not finite."""
    if got.keys() != want.keys():
        return [f"keys {sorted(got.keys() ^ want.keys())}"]
    out = []
    for k, w in want.items():
        g = got[k]
        if g.shape != w.shape or g.dtype != w.dtype:
            out.append(f"{k}: {g.dtype}{tuple(g.shape)} != {w.dtype}{tuple(w.shape)}")
        elif bool((w == w.flatten()[0]).all()):
            out += [] if torch.equal(g, w) else [f"{k}: not {float(w.flatten()[0])} everywhere"]
        elif w.numel() >= 256:
            gm, gs, wm, ws = float(g.mean()), float(g.std()), float(w.mean()), float(w.std())
            out += [] if abs(gm - wm) <= 0.3 * ws and abs(gs / ws - 1) <= 0.2 else [f"{k}: mean {gm:.3g} std "
                                                                                      f"{gs:.3g}, want {wm:.3g} {ws:.3g}"]
        elif not (bool(g.isfinite().all()) and bool((g != g.flatten()[0]).any())):
            out.append(f"{k}: constant or not finite")
    return out
