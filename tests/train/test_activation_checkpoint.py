"""`--activation-checkpointing`: per-block recomputation gives the losses, gradients and router-load
counts of a run without it (one process here; 2 processes with FSDP2 and --ep in `test_scale_torchrun.py`),
including the IndexCache "shared" layers re-run in the backward (tiny has own and shared DSA layers)."""

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.parallel.activation_checkpoint import apply_activation_checkpointing
from glm5lab.train.balance import moe_layers
from glm5lab.train.losses import stage_losses
from glm5lab.train.stages import Stage
from glm5lab.train.step import set_trainable

AC_TOL = dict(rtol=0.0, atol=0.0)
"""fp32 CPU, same kernels on the same inputs in the same order: bit-equal (observed: equal)."""

SEQ = 24
STAGES = {
    "dense": Stage("dense", 1, 3e-3, SEQ, 2),
    "indexer_warmup": Stage("indexer_warmup", 1, 5e-3, SEQ, 2, trainable="indexer", lm_weight=0.0,
                            mtp_weights=(0.0,), indexer_weight=1.0),
    "sparse_adaptation": Stage("sparse_adaptation", 1, 3e-4, SEQ, 2, use_dsa=True, indexer_weight=1.0),
}


def _model():
    cfg = ModelConfig.from_preset("tiny", vocab_size=320)
    assert cfg.index_topk < SEQ and "shared" in [s.indexer for s in cfg.layers]  # DSA selects; IndexCache reuses
    torch.manual_seed(0)
    return GLM5ForCausalLM(cfg).train()


def _step(model, stage, window):
    set_trainable(model, stage)
    losses = stage_losses(model, window, stage)
    losses.total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loads = [moe.pop_load() for _, moe in moe_layers(model)]
    return losses.to_log(), grads, loads


@pytest.mark.parametrize("name", list(STAGES))
def test_checkpointed_blocks_give_the_same_losses_gradients_and_loads(name):
    window = torch.randint(0, 320, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    plain, ac = _model(), _model()
    apply_activation_checkpointing(ac)
    assert list(dict(ac.named_parameters())) == list(dict(plain.named_parameters()))  # names unchanged
    want, got = _step(plain, STAGES[name], window), _step(ac, STAGES[name], window)
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys() and want[1]
    for key in want[1]:
        torch.testing.assert_close(got[1][key], want[1][key], **AC_TOL, msg=key)
    assert [x.tolist() for x in got[2]] == [x.tolist() for x in want[2]]  # counted once, not per recomputation
    assert sum(int(x.sum()) for x in want[2]) > 0


def test_cli_flags_and_the_refused_combination(monkeypatch):
    from glm5lab.cli import build_parser
    from glm5lab.train.loop import TrainArgs, train

    parsed = build_parser().parse_args(["train", "--activation-checkpointing", "--tensorboard"])
    assert parsed.activation_checkpointing is True and parsed.tensorboard is True
    plain = build_parser().parse_args(["train"])
    assert plain.activation_checkpointing is False and plain.tensorboard is False
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"^--compile with --activation-checkpointing is not supported with 2 processes"):
        train(TrainArgs(preset="tiny", compile=True, activation_checkpointing=True))
