"""`optim.flops`: the Newton-Schulz FLOPs of a step, by hand for one matrix and against
`torch.utils.flop_counter.FlopCounterMode` around a real `MuonAdamW.step` (integers: exact)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.optim import OPTIMIZERS, build_optimizer, indexer_parameter_names, newton_schulz
from glm5lab.optim.flops import newton_schulz_flops, optimizer_flops
from glm5lab.optim.muon import blocks


def test_one_matrix_by_hand():
    # 3 x 5: m = 3, n = 5; per step X X^T 2*3*3*5 = 90, A A 2*27 = 54, B X 90: 234; 5 steps 1170
    assert newton_schulz_flops(3, 5) == 1170 == newton_schulz_flops(5, 3)
    assert newton_schulz_flops(3, 5, steps=0) == 0
    with FlopCounterMode(display=False) as fc:
        newton_schulz(torch.randn(5, 3))
    assert fc.get_total_flops() == 1170


@pytest.mark.parametrize("bad", [dict(rows=0, cols=3), dict(rows=3, cols=-1), dict(rows=2, cols=2, steps=-1)])
def test_bad_shapes_are_refused(bad):
    with pytest.raises(ValueError):
        newton_schulz_flops(**bad)


@pytest.mark.parametrize("bad", [dict(shape=(8, 4), kind="sgd"), dict(shape=(8, 4), kind="muon", sections=(4, 4)),
                                 dict(shape=(8, 4), kind="muon_split", heads=None),
                                 dict(shape=(9, 4), kind="muon_split", heads=2), dict(shape=(8,), kind="muon"),
                                 dict(shape=(8, 4), kind="muon_split", heads=2, sections=(3, 2))])
def test_blocks_refuses_what_the_optimizer_refuses(bad):
    with pytest.raises(ValueError):
        blocks(**bad)


def test_blocks_per_kind():
    assert blocks((8, 4), "adamw") == []
    assert blocks((8, 4), "muon") == [(8, 4)]
    assert blocks((3, 8, 4), "muon") == [(8, 4)] * 3
    assert blocks((8, 4), "muon_split", 2) == [(4, 4)] * 2
    assert blocks((10, 4), "muon_split", 2, (3, 2)) == [(3, 4), (2, 4)] * 2


def _step_flops(model, optimizer: str, trains=None) -> int:
    opt = build_optimizer(model, optimizer, lr=1e-3)
    for name, p in model.named_parameters():
        p.grad = None if trains is not None and not trains(name) else torch.randn_like(p)
    with FlopCounterMode(display=False) as fc:
        opt.step()
    return fc.get_total_flops()


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_count_equals_flop_counter_on_a_real_step(optimizer):
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny"))
    counted = optimizer_flops(model, optimizer)
    assert counted["newton_schulz"] == _step_flops(model, optimizer)
    assert counted["muon_params"] + counted["adamw_params"] == sum(p.numel() for p in model.parameters())
    if optimizer == "adamw":
        assert counted["newton_schulz"] == counted["blocks"] == 0
    indexer = indexer_parameter_names(model)
    only = optimizer_flops(model, optimizer, trains=indexer.__contains__)
    assert only["newton_schulz"] == _step_flops(model, optimizer, trains=indexer.__contains__)
    assert only["newton_schulz"] < counted["newton_schulz"] or optimizer == "adamw"


def test_splitting_costs_less_and_kv_apart_least():
    """Smaller blocks: NS cost falls with m (m^2 n per block): whole > per head > per K / V section."""
    with torch.device("meta"):
        model = GLM5ForCausalLM(ModelConfig.from_preset("small"))
    cost = {o: optimizer_flops(model, o)["newton_schulz"] for o in OPTIMIZERS}
    assert cost["muon"] > cost["muon-split"] > cost["muon-split-kv"] > cost["adamw"] == 0
