"""Meta-device build + per-shard init (`glm5lab.parallel.meta_init`, `dist.build_meta` / `dist.materialize`): the
recorded build replayed tensor by tensor equals `torch.manual_seed(seed); GLM5ForCausalLM(cfg)` on the CPU bit
for bit (every parameter and buffer; GDN's computed `A_log`/`dt_bias`, tied embeddings, norms of ones), and
leaves the generator where that build does. Under torchrun (2 processes, with and without --ep):
`test_scale_torchrun.py`."""

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.parallel.meta_init import record_build

MIXED = dict(attention_types=["mla", "mla", "gqa", "gqa"], mixer_types=["full", "gdn", "full", "simple_gdn"],
             num_key_value_heads=2)


@pytest.mark.parametrize("overrides", [{}, {**MIXED, "tie_word_embeddings": True}], ids=["tiny", "mixed-tied"])
def test_replayed_init_equals_the_seeded_cpu_build(overrides):
    cfg = ModelConfig.from_preset("tiny").replace(**overrides)
    torch.manual_seed(7)
    reference = GLM5ForCausalLM(cfg)
    rng_after = torch.get_rng_state()
    torch.manual_seed(123)  # record_build seeds itself
    model, record = record_build(lambda: GLM5ForCausalLM(cfg), 7)
    assert all(t.is_meta for t in model.state_dict().values())  # nothing allocated
    assert torch.equal(torch.get_rng_state(), rng_after)
    model.to_empty(device="cpu")
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    record.materialize([(record.named[n], t) for n, t in tensors], lambda target, full: full)
    assert torch.equal(torch.get_rng_state(), rng_after)  # the replay's draws leave no trace
    want = reference.state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert torch.randn(3).tolist() == (torch.set_rng_state(rng_after), torch.randn(3))[1].tolist()


def test_a_partial_write_is_refused():
    def build():
        w = torch.empty(4, 4)
        w[0].normal_()  # writes part of a storage: not replayable per storage
        return torch.nn.Linear(4, 4)

    with pytest.raises(RuntimeError, match="meta init: .* writes part of a meta tensor"):
        record_build(build, 0)
