"""Gradient accumulation (`glm5lab.train.step.forward_backward`): a step of A micro-batches of B rows equals one
step on the A*B rows at once, in every stage kind (dense with MTP depths, indexer warm-up's KL, sparse adaptation
with DSA on and the indexer KL): logged losses and updated weights within fp32 tolerance, router-bias loads
exactly equal.

Tolerance (fp32, CPU): the micro-batch path sums A partial gradients instead of one batched reduction, so they
differ by rounding only. Losses rel 1e-5 (observed ~1e-7), gradient norms rel 1e-4 (observed <= 1e-6), weights
outside the indexer the table's atol/rtol 1e-5; the indexer's weights atol 1e-4 (observed 2.6e-5 after the
5 steps): its KL gradients are tiny (norm 4e-4) and AdamW divides each entry by its own RMS, so entries near zero
turn rounding into a visible part of the 5e-3 step. A step that drops one micro-batch fails all of these."""

import copy

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.train.losses import stage_losses
from glm5lab.train.stages import Stage
from glm5lab.train.recipe import TrainHyper
from glm5lab.train.step import run_stages, split_batch
from tests.conftest import assert_close, free_port
from tests.train.conftest import logged_losses, shared_init, tiny_plan

B, A, T = 2, 3, 12
OFFSET = (0, 2, 3)  # first step of each stage in `windows` (stages of 2, 1, 2 steps)
HYPER = TrainHyper.default(optimizer="adamw")


def _stages(grad_accum: int, batch: int) -> list[Stage]:
    return [
        Stage("dense", 2, 3e-3, T, batch, warmup_steps=1, grad_accum=grad_accum),
        Stage("indexer_warmup", 1, 5e-3, T, batch, trainable="indexer", lm_weight=0.0, mtp_weights=(0.0,),
              indexer_weight=1.0, grad_accum=grad_accum),
        Stage("sparse_adaptation", 2, 3e-4, T, batch, use_dsa=True, indexer_weight=1.0, grad_accum=grad_accum),
    ]


def _train(cfg: ModelConfig, grad_accum: int, batch: int, windows: torch.Tensor) -> tuple[GLM5ForCausalLM, list]:
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg)
    records = []
    run_stages(model, _stages(grad_accum, batch), lambda index, stage, i: windows[OFFSET[index] + i], HYPER,
               records.append, losses=lambda w, stage: stage_losses(model, w, stage))
    return model, records


def test_micro_batches_equal_one_batch():
    cfg = ModelConfig.from_preset("tiny", vocab_size=97)
    assert cfg.index_topk < T and cfg.num_nextn_predict_layers
    torch.manual_seed(1)
    windows = torch.randint(0, 97, (5, A * B, T + 1))
    whole, want = _train(cfg, 1, A * B, windows)
    accum, got = _train(cfg, A, B, windows)
    for r_got, r_want in zip(got, want, strict=True):
        log_got, log_want = r_got.losses.to_log(), r_want.losses.to_log()
        for key in ("loss", "lm_loss", "indexer_kl"):
            if log_want[key] is None:
                assert log_got[key] is None
            else:
                assert log_got[key] == pytest.approx(log_want[key], rel=1e-5, abs=1e-6), (r_got.stage.name, key)
        assert log_got["mtp_losses"] == pytest.approx(log_want["mtp_losses"], rel=1e-5, abs=1e-6)
        assert r_got.expert_load == r_want.expert_load  # the router's counts: the sum over micro-batches
        assert r_got.grad_norm == pytest.approx(r_want.grad_norm, rel=1e-4)
    assert [r.stage.name for r in got] == ["dense"] * 2 + ["indexer_warmup"] + ["sparse_adaptation"] * 2
    assert got[2].losses.indexer is not None and got[4].losses.indexer is not None and len(got[0].losses.mtp) == 3
    want_state, got_state = whole.state_dict(), accum.state_dict()
    for name, value in want_state.items():
        assert_close(got_state[name], value, msg=name, **({"atol": 1e-4} if ".indexer." in name else {}))
    moved = [n for n, v in want_state.items() if v.is_floating_point() and not torch.equal(v, _initial(cfg)[n])]
    assert any("e_score_correction_bias" in n for n in moved)  # the router bias did move (and equally)


def test_garbage_accumulation_fails():
    """The tolerance is not too loose: a step that drops its last micro-batch (zero loss) is caught."""
    cfg = ModelConfig.from_preset("tiny", vocab_size=97)
    torch.manual_seed(1)
    windows = torch.randint(0, 97, (5, A * B, T + 1))
    whole, _ = _train(cfg, 1, A * B, windows)
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg)

    calls = []

    def drop_last(w, stage):
        out = stage_losses(model, w, stage)
        calls.append(1)
        out.total = out.total * (0.0 if len(calls) % A == 0 else 1.0)
        return out

    run_stages(model, _stages(A, B), lambda index, stage, i: windows[OFFSET[index] + i], HYPER, lambda done: None,
               losses=drop_last)
    for weight in ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.indexer.wk.weight"):
        with pytest.raises(AssertionError):
            assert_close(model.state_dict()[weight], whole.state_dict()[weight], atol=1e-4)


def _initial(cfg):
    torch.manual_seed(0)
    return copy.deepcopy(GLM5ForCausalLM(cfg).state_dict())


def test_split_batch_rows_and_refusal():
    rows = torch.arange(12).view(6, 2)
    parts = split_batch(rows, 3)
    assert [p.tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    pairs = split_batch((rows, rows + 100), 2)
    assert isinstance(pairs[0], tuple) and pairs[1][1].tolist() == [[106, 107], [108, 109], [110, 111]]
    with pytest.raises(ValueError, match="grad_accum = 4"):
        split_batch(rows, 4)


DRIVER = """
import json, sys
from glm5lab.parallel.dist import end_process
from glm5lab.train.loop import TrainArgs, train
out, plan = sys.argv[1], json.loads(sys.argv[2])
train(TrainArgs(init=sys.argv[3] + "/init", data=sys.argv[3] + "/texts", out=out, progress=False,
                eval_every=0, checkpoint_every=0, stage_plan=plan))
end_process()  # leave as every multi-process run does (glm5lab.parallel.dist.end_process)
"""


@pytest.mark.slow  # 19 s under torchrun; the accumulation itself is pinned by the one-process tests above
def test_fsdp_accumulation_matches_one_process(tmp_path, monkeypatch):
    """torchrun 2 processes x 2 micro-batches of 1 (FSDP2, gradient sync on the last micro-batch only) == one
    process with the same 4 global rows in one batch: logged losses within 1e-4 relative (the loop's FSDP
    tolerance, tests/train/test_fsdp.py), tokens counted alike."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import write_word_corpus

    monkeypatch.setenv("GLM5LAB_CACHE", str(tmp_path / "cache"))
    write_word_corpus(tmp_path / "texts")
    cfg = ModelConfig.from_preset("tiny", vocab_size=320)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    shared_init(tmp_path)  # both start from it: a fresh run under torchrun draws its own shards
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    plan = lambda batch, accum: json.dumps([{**stage, "grad_accum": accum}  # noqa: E731
                                            for stage in tiny_plan(steps=(2, 1, 2), batch=batch)])
    one = subprocess.run([sys.executable, str(driver), str(tmp_path / "one"), plan(4, 1), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={free_port()}", str(driver), str(tmp_path / "two"), plan(1, 2),
                          str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = logged_losses(tmp_path / "one"), logged_losses(tmp_path / "two")
    assert len(a) == len(b) == 5
    for row_a, row_b in zip(a, b, strict=True):
        for x, y in zip(row_a, row_b, strict=True):
            assert (x is None) == (y is None) and (x is None or abs(x - y) <= 1e-4 * max(1.0, abs(x))), (a, b)
    tokens = lambda run: [json.loads(r)["tokens"] for r in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert tokens(tmp_path / "one") == tokens(tmp_path / "two") == [4 * 24] * 5
