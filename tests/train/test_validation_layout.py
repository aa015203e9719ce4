"""The periodic validation scores a set fixed by tokens (`eval_tokens`), not by batches (issue 36, fault 6):
batch 4 x accumulation 2 and batch 8 train the same global batches, so they log the same `val_tokens` and, up to
the rounding by which the two layouts' weights differ, the same `val_loss`. Before the fix the subset was
`eval_batches` x the micro-batch (x processes): 8 windows against 16 here, and val_loss differed by ~1e-2.

Tolerance (fp32, CPU): the accumulated step sums two partial gradients instead of one batched reduction, so the
weights differ by rounding (tests/train/test_grad_accum.py); observed val_loss differences ~1e-7 relative,
allowed 1e-5. Different windows differ by far more (the garbage check below)."""

import json

import pytest

from glm5lab.train.evaluation import subset_windows
from glm5lab.train.loop import TrainArgs, train
from glm5lab.train.stages import Stage

SEQ = 24


def _plan(batch: int, grad_accum: int) -> list[dict]:
    return [Stage("dense", 3, 3e-3, SEQ, batch, warmup_steps=1, grad_accum=grad_accum, mtp_weights=(0.3,)).to_dict()]


def _val_rows(corpus, name: str, batch: int, grad_accum: int, eval_tokens: int = 8 * SEQ) -> list[dict]:
    out = corpus / name
    train(TrainArgs(config=str(corpus / "config.json"), data=str(corpus / "texts"), out=str(out), progress=False,
                    eval_every=3, eval_tokens=eval_tokens, checkpoint_every=0, optimizer="adamw",
                    stage_plan=_plan(batch, grad_accum)))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("val_loss") is not None]


def test_validation_is_the_same_set_for_any_batch_layout(corpus):
    whole, accum = _val_rows(corpus, "b8", 8, 1), _val_rows(corpus, "b4a2", 4, 2)
    assert [r["val_tokens"] for r in whole] == [r["val_tokens"] for r in accum] == [8 * SEQ]
    assert accum[0]["val_loss"] == pytest.approx(whole[0]["val_loss"], rel=1e-5)
    other = _val_rows(corpus, "fewer", 8, 1, eval_tokens=4 * SEQ)  # garbage check: another set of windows
    assert other[0]["val_loss"] != pytest.approx(whole[0]["val_loss"], rel=1e-3)


def test_subset_windows_by_tokens():
    assert subset_windows(16384, 256) == 64  # the small recipe: the 64 windows the default run has always scored
    assert subset_windows(100, 24) == 5  # at least eval_tokens targets: ceil
    assert subset_windows(1, 4096) == 1
    for bad in ((0, 24), (24, 0), (-5, 24)):
        with pytest.raises(ValueError, match="integers >= 1"):
            subset_windows(*bad)


@pytest.mark.parametrize("evaluation, match", [
    ("eval_batches = 8", r"\[evaluation\] key `eval_batches` was replaced by `eval_tokens`.*eval_tokens = 16384"),
    ("eval_tokens = 0", r"\[evaluation\]\.eval_tokens = 0 is not allowed: an integer >= 1"),
])
def test_recipe_eval_keys_refused_in_one_line(tmp_path, evaluation, match):
    from glm5lab.train.recipe import load_recipe

    path = tmp_path / "r.toml"
    path.write_text(f'name = "r"\n[evaluation]\n{evaluation}\n[[stages]]\nname = "dense"\nsteps = 2\nlr = 1e-3\n'
                    "seq_len = 16\nbatch_size = 2\n")
    with pytest.raises(ValueError, match=match):
        load_recipe(str(path))
