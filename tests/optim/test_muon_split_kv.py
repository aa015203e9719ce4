"""Muon Split with K and V apart ("muon-split-kv"): `muon_split(..., sections=)` against its per-block loop
(`muon_split_reference`), the seed's orthonormal-rows property per section, the group table, one
`MuonAdamW` step against a hand computation, the Newton-Schulz call count, and bad input.

Tolerances (fp32): BLOCK atol/rtol 1e-5, batched sections vs one block at a time (batched GEMM may pick
other kernels; observed < 2e-6); ORTHO atol 1e-5 for rows of an exact polar factor (observed ~1e-6);
STEP atol 1e-6 for a parameter after one step against the same formula written out (observed 0: the
same ops on the same tensors, up to the batching of the head blocks).
"""

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.optim import MuonAdamW, adjust_lr, build_optimizer, newton_schulz, orthogonalize_exact
from glm5lab.optim.groups import param_group_table
from glm5lab.optim.newton_schulz import muon_split, muon_split_reference

BLOCK_TOL = {"atol": 1e-5, "rtol": 1e-5}
ORTHO_ATOL = 1e-5
STEP_TOL = {"atol": 1e-6, "rtol": 1e-6}


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("heads,sections,cols", [(1, (1, 2), 5), (3, (3, 2), 7), (2, (4, 4), 9), (4, (5, 1, 2), 3),
                                                 (2, (7,), 4)])
@pytest.mark.parametrize("ortho", [orthogonalize_exact, newton_schulz], ids=["exact", "ns"])
def test_sections_equal_the_per_block_loop(heads, sections, cols, ortho):
    update = _randn(heads * sum(sections), cols, seed=heads)
    fast = muon_split(update, heads, orthogonalize=ortho, sections=sections)
    torch.testing.assert_close(fast, muon_split_reference(update, heads, orthogonalize=ortho, sections=sections),
                               **BLOCK_TOL)
    loop = torch.cat([ortho(block) for head in update.chunk(heads) for block in head.split(list(sections))])
    torch.testing.assert_close(fast, loop, **BLOCK_TOL)


def test_one_section_is_plain_muon_split_and_two_differ():
    update = _randn(12, 8)
    torch.testing.assert_close(muon_split(update, 2, sections=(6,)), muon_split(update, 2), **BLOCK_TOL)
    torch.testing.assert_close(muon_split_reference(update, 2), muon_split(update, 2), **BLOCK_TOL)
    assert (muon_split(update, 2, sections=(3, 3)) - muon_split(update, 2)).abs().max() > 0.1


def test_every_section_has_orthonormal_rows_exact():
    """The seed's muon_split property, per K block and per V block: each has orthonormal rows."""
    update = _randn(2 * (3 + 2), 6, seed=3)
    out = muon_split(update, 2, sections=(3, 2))
    for head in out.chunk(2):
        for block in head.split([3, 2]):
            torch.testing.assert_close(block @ block.T, torch.eye(len(block)), atol=ORTHO_ATOL, rtol=0)
    whole_head = out[:5]
    assert (whole_head @ whole_head.T - torch.eye(5)).abs().max() > 0.05  # K rows not orthogonal to V rows


@pytest.mark.parametrize("sections", [(2, 2), (0, 5), (5, 0), (), (2.5, 2.5), (True, 4), 5, "23"])
def test_bad_sections_are_refused(sections):
    with pytest.raises(ValueError, match="sections"):
        muon_split(_randn(10, 4), 2, sections=sections)
    with pytest.raises(ValueError, match="sections"):
        muon_split_reference(_randn(10, 4), 2, sections=sections)


def _tiny():
    torch.manual_seed(0)
    return GLM5ForCausalLM(ModelConfig.from_preset("tiny"))


def test_group_table_cuts_only_kv_b_into_k_and_v():
    model = _tiny()
    cfg = model.config
    kv = {r.name: r for r in param_group_table(model, "muon-split-kv")}
    split = {r.name: r for r in param_group_table(model, "muon-split")}
    assert kv.keys() == split.keys()
    cut = {n for n, r in kv.items() if r.sections is not None}
    assert cut and all(n.endswith("self_attn.kv_b_proj.weight") for n in cut)
    assert any(n.startswith("model.mtp_layers.") for n in cut)
    for name, row in kv.items():
        if name in cut:
            assert row.sections == (cfg.qk_nope_head_dim, cfg.v_head_dim) and row.kind == "muon_split"
            assert row.heads == cfg.num_attention_heads
        else:
            assert row == split[name]


def test_build_optimizer_puts_sections_in_their_own_group_and_round_trips():
    model = _tiny()
    opt = build_optimizer(model, "muon-split-kv", lr=1e-3)
    with_sections = [g for g in opt.param_groups if g.get("sections") is not None]
    assert len(with_sections) == 1 and with_sections[0]["sections"] == (16, 16)
    assert {id(p) for p in with_sections[0]["params"]} == {
        id(p) for n, p in model.named_parameters() if n.endswith("kv_b_proj.weight")}
    again = build_optimizer(_tiny(), "muon-split-kv", lr=1e-3)
    again.load_state_dict(opt.state_dict())
    assert [g.get("sections") for g in again.param_groups] == [g.get("sections") for g in opt.param_groups]


@pytest.mark.parametrize("fn", ["original", "match_rms_adamw"])
def test_one_step_equals_the_formula_per_section(fn):
    """Unequal sections of a tall head block, so "original"'s lr scale differs per section."""
    heads, sections, cols = 2, (5, 2), 3
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(heads * sum(sections), cols))
    p0, g = p.detach().clone(), torch.randn_like(p)
    p.grad = g.clone()
    lr, wd, mom = 0.02, 0.1, 0.95
    calls = []
    opt = MuonAdamW([{"params": [p], "kind": "muon_split", "heads": heads, "sections": sections}], lr=lr,
                    weight_decay=wd, momentum=mom, adjust_lr_fn=fn, on_orthogonalize=lambda _, n: calls.append(n))
    opt.step()
    u = g.lerp(g * (1 - mom), mom)  # Nesterov on a zero buffer: buf = (1 - m) g
    expected = p0 * (1 - lr * wd)
    rows = []
    for head in u.chunk(heads):
        for block in head.split(list(sections)):
            rows.append(adjust_lr(lr, fn, tuple(block.shape)) * newton_schulz(block))
    expected = expected - torch.cat(rows)
    torch.testing.assert_close(p.detach(), expected, **STEP_TOL)
    assert calls == [heads] * len(sections)  # each section goes through NS as one batch of `heads` blocks


def test_sections_are_refused_outside_muon_split_or_when_they_do_not_fit():
    p = torch.nn.Parameter(torch.zeros(8, 4))
    with pytest.raises(ValueError, match="sections"):
        MuonAdamW([{"params": [p], "kind": "muon", "sections": (4, 4)}])
    with pytest.raises(ValueError, match="sections"):
        MuonAdamW([{"params": [p], "kind": "muon_split", "heads": 2, "sections": (3, 2)}])


@pytest.mark.parametrize("heads", [True, 2.0, 0])
def test_heads_that_are_not_positive_ints_are_refused(heads):
    for split in (muon_split, muon_split_reference):
        with pytest.raises(ValueError, match="heads"):
            split(_randn(4, 3), heads)


def test_bool_sections_are_refused_by_the_optimizer_too():
    p = torch.nn.Parameter(torch.zeros(8, 6))
    with pytest.raises(ValueError, match="sections"):
        MuonAdamW([{"params": [p], "kind": "muon_split", "heads": 2, "sections": (True, 3)}])


@pytest.mark.parametrize("edit", [{"sections": (2, 2, 2)}, {"kind": "muon"}, {"kind": "adamw"}])
def test_load_state_dict_checks_the_saved_groups(edit):
    """A saved group edited by hand (sections that no longer fit, or sections on another kind) is refused at load,
    as the constructor refuses it, not at the first step."""
    model = _tiny()
    state = build_optimizer(model, "muon-split-kv", lr=1e-3).state_dict()
    group = next(g for g in state["param_groups"] if g.get("sections") is not None)
    group.update(edit)
    with pytest.raises(ValueError, match="sections"):
        build_optimizer(model, "muon-split-kv", lr=1e-3).load_state_dict(state)


def test_kv_split_needs_both_sections():
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", qk_nope_head_dim=0))
    with pytest.raises(ValueError, match="qk_nope_head_dim = 0.*muon-split"):
        param_group_table(model, "muon-split-kv")
    assert param_group_table(model, "muon-split")  # the per-head split alone is fine
