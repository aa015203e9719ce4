"""Meta-device build + per-shard init (`dist.build_meta`, `dist.materialize`, `GLM5ForCausalLM.reset_parameters`):
each rank draws only its own shards, from the distributions of one process's `torch.manual_seed(s);
GLM5ForCausalLM(cfg)` (no tensor left as allocated; norms, biases and buffers exactly; weights by mean and std; GDN
decays in their ranges) with a generator seeded by (seed, rank): the same values for the same seed and rank, others
for another rank or seed, never the global generator. Not one process's values (docs/scaling.md). Sharded under
torchrun (2 processes, with and without --ep): `test_scale_torchrun.py`."""

import math

import pytest
import torch
from torch.nn.functional import softplus

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.model.gdn_layer import GatedDeltaNet, SimpleGDN
from glm5lab.parallel import dist
from tests.train.conftest import init_differences

MIXED = dict(attention_types=["mla", "mla", "gqa", "gqa"], mixer_types=["full", "gdn", "full", "simple_gdn"],
             num_key_value_heads=2)
GQA_BIAS = dict(attention_types=["gqa"] * 4, index_n_heads=0, index_head_dim=0, use_dsa=False, q_lora_rank=0,
                kv_lora_rank=0, use_qk_norm=True, attention_bias=True)
CONFIGS = [pytest.param({}, id="tiny"), pytest.param({**MIXED, "tie_word_embeddings": True}, id="mixed-tied"),
           pytest.param(GQA_BIAS, id="gqa-qk-norm-bias")]


def _seeded(cfg, seed=7) -> dict:
    torch.manual_seed(seed)
    return GLM5ForCausalLM(cfg).state_dict()


def _drawn(cfg, seed, rank, world) -> dict:
    model = dist.build_meta(cfg)
    assert all(t.is_meta for t in model.state_dict().values())  # the build allocates and draws nothing
    dist.materialize(model, dist.DistContext(rank, world, torch.device("cpu")), seed)
    return model.state_dict()


@pytest.mark.parametrize("overrides", CONFIGS)
def test_reset_parameters_draws_every_tensor_as_the_seeded_build(overrides):
    """Every tensor overwritten (none left from before: NaN here), each drawn as the seeded build draws it."""
    cfg = ModelConfig.from_preset("tiny").replace(**overrides)
    want = _seeded(cfg)
    model = GLM5ForCausalLM(cfg)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(math.nan)
    model.reset_parameters(torch.Generator().manual_seed(3))
    got = model.state_dict()
    assert init_differences(got, want) == []
    for name, m in model.named_modules():  # the GDN decays, whose few values the generic check cannot judge
        if isinstance(m, GatedDeltaNet):
            assert m.A_log.exp().min() >= 0.01 and m.A_log.exp().max() <= 16 and torch.equal(m.dt_bias, torch.ones(4))
        if isinstance(m, SimpleGDN):
            assert m.A_log.exp().min() >= 1 and m.A_log.exp().max() <= 16 and not m.b_bias.any()
            dt = softplus(m.dt_bias)
            assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5), name


@pytest.mark.parametrize("overrides", CONFIGS)
def test_materialize_is_reproducible_per_seed_and_rank(overrides):
    cfg = ModelConfig.from_preset("tiny").replace(**overrides)
    want = _seeded(cfg)
    rng = torch.get_rng_state()
    a, b = _drawn(cfg, 7, 0, 1), _drawn(cfg, 7, 0, 1)
    assert torch.equal(torch.get_rng_state(), rng)  # its own generator: the global one is untouched
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert init_differences(a, want) == []
    random = [k for k, w in want.items() if not bool((w == w.flatten()[0]).all())]
    for other in (_drawn(cfg, 7, 1, 2), _drawn(cfg, 8, 0, 1)):  # another rank, another seed
        assert init_differences(other, want) == []
        assert not any(torch.equal(a[k], other[k]) for k in random)
    assert not any(torch.equal(a[k], want[k]) for k in random)  # not the one-process values
