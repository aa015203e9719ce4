"""Values kept in fp32 (issue 11): the router's weight and `e_score_correction_bias`, the
indexer's `weights_proj` and `k_norm` (main layers and the MTP layer) stay fp32 and bit-equal to
their source through every cast and load path, and the routing/index scores are fp32 under
autocast. The GLM-5.2-like bias (6.8 + 0.25 U(0,1), 256 experts, top-8) routes a bf16 model
exactly as the fp32 model, while the same bias rounded through bf16 does not (so the test sees
the bug it guards against)."""

import os
import subprocess
import sys

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.model.moe import Router
from glm5lab.model.precision import KeepFP32
from tests.conftest import free_port

LOW = [torch.bfloat16, torch.float16]


def _glm52_bias(model, seed=0):
    """Every router's bias set to GLM-5.2-like values: 6.8 + 0.25 * U(0, 1) (fp32)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Router):
                m.e_score_correction_bias.copy_(6.8 + 0.25 * torch.rand(m.e_score_correction_bias.shape, generator=g))
    return model


def _model(**changes):
    torch.manual_seed(0)
    return _glm52_bias(GLM5ForCausalLM(ModelConfig.from_preset("tiny", **changes)))


def _kept(model) -> dict[str, torch.Tensor]:
    """The KeepFP32 tensors by state-dict name (router weight + bias, indexer weights_proj, k_norm)."""
    names = {n for n, m in model.named_modules() if isinstance(m, KeepFP32)}
    return {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[0] in names}


def _assert_bit_equal(model, ref: dict[str, torch.Tensor]):
    kept = _kept(model)
    assert set(kept) == set(ref)
    for k, v in kept.items():
        assert v.dtype == torch.float32, f"{k} is {v.dtype}"
        assert torch.equal(v, ref[k]), f"{k} changed by up to {(v - ref[k]).abs().max():.3g}"


def test_the_kept_set_is_every_router_and_indexer_precision_value():
    kept = _kept(_model())
    main = {k for k in kept if k.startswith("model.layers.")}
    mtp = {k for k in kept if k.startswith("model.mtp_layers.0.")}
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in main and "model.layers.1.mlp.gate.weight" in main
    assert {"model.mtp_layers.0.mlp.gate.weight", "model.mtp_layers.0.mlp.gate.e_score_correction_bias",
            "model.mtp_layers.0.self_attn.indexer.weights_proj.weight",
            "model.mtp_layers.0.self_attn.indexer.k_norm.weight", "model.mtp_layers.0.self_attn.indexer.k_norm.bias"} <= mtp
    assert "model.layers.0.self_attn.indexer.weights_proj.weight" in main  # a full indexer layer
    assert not any("q_a_proj" in k or "experts" in k for k in kept)


@pytest.mark.parametrize("cast", ["to_bf16", "to_fp16", "half", "bfloat16", "to_device_and_dtype"])
def test_module_casts_keep_the_values_bit_equal(cast):
    model = _model()
    ref = {k: v.clone() for k, v in _kept(model).items()}
    {"to_bf16": lambda m: m.to(torch.bfloat16), "to_fp16": lambda m: m.to(torch.float16), "half": lambda m: m.half(),
     "bfloat16": lambda m: m.bfloat16(), "to_device_and_dtype": lambda m: m.to("cpu", torch.bfloat16)}[cast](model)
    _assert_bit_equal(model, ref)
    assert model.model.layers[1].self_attn.q_a_proj.weight.dtype in LOW  # the rest was cast
    model.float()  # and back: still the same bits
    _assert_bit_equal(model, ref)


def test_wider_casts_apply_and_narrow_ones_stop_at_fp32():
    """double() widens them too (lossless); a later cast to fp16 stops at fp32, and every dtype
    runs a forward (the kept modules compute in their own dtype)."""
    model = _model()
    ref = {k: v.clone() for k, v in _kept(model).items()}
    ids = torch.randint(0, 512, (1, 12))
    model.double()
    assert all(v.dtype == torch.float64 for v in _kept(model).values())
    model(ids)
    model.to(torch.float16)
    _assert_bit_equal(model, ref)  # fp64 -> fp32 of values that came from fp32: exact
    model(ids)
    model.float()
    _assert_bit_equal(model, ref)
    model(ids)


def test_narrow_weights_handed_in_from_outside_still_compute_in_fp32():
    """torch.func.functional_call with bf16 tensors bypasses the module's own (fp32) weights: the
    kept modules still compute in fp32 (from the bf16 values) and return fp32."""
    model = _model()
    indexer, gate = model.model.layers[0].self_attn.indexer, model.model.layers[1].mlp.gate
    x = torch.randn(3, model.config.hidden_size)
    w16 = {k: v.bfloat16() for k, v in indexer.weights_proj.state_dict().items()}
    out = torch.func.functional_call(indexer.weights_proj, w16, (x.bfloat16(),))
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.nn.functional.linear(x.bfloat16().float(), w16["weight"].float()))
    g16 = {k: v.bfloat16() for k, v in gate.state_dict().items()}
    w, idx, scores = torch.func.functional_call(gate, g16, (x,))
    assert w.dtype == scores.dtype == torch.float32


def test_cast_with_gradients_keeps_them_fp32():
    model = _model()
    model(torch.randint(0, 512, (1, 12)), mtp_depth=1).logits.sum().backward()
    gate = model.model.layers[1].mlp.gate
    grad = gate.weight.grad.clone()
    model.to(torch.bfloat16)
    assert gate.weight.grad.dtype == torch.float32 and torch.equal(gate.weight.grad, grad)


@pytest.mark.parametrize("dtype", LOW)
def test_from_pretrained_dtype_keeps_the_checkpoint_values(tmp_path, dtype):
    model = _model()
    model.save_pretrained(tmp_path)
    ref = {k: v.clone() for k, v in _kept(model).items()}
    loaded = GLM5ForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    _assert_bit_equal(loaded, ref)
    assert loaded.model.layers[1].self_attn.q_a_proj.weight.dtype == dtype


def test_a_bf16_checkpoint_loads_them_as_fp32_with_the_stored_values(tmp_path):
    """A checkpoint written from a bf16 copy: its kept tensors are stored fp32 (they never became
    bf16), and if a file holds them in bf16 they load as fp32 holding exactly those values."""
    model = _model()
    ref = {k: v.clone() for k, v in _kept(model).items()}
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    _assert_bit_equal(GLM5ForCausalLM.from_pretrained(tmp_path), ref)
    from safetensors.torch import load_file, save_file

    stored = load_file(tmp_path / "model.safetensors")
    assert stored["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in stored.items()},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = GLM5ForCausalLM.from_pretrained(tmp_path)
    _assert_bit_equal(loaded, {k: v.bfloat16().float() for k, v in ref.items()})
    assert loaded.model.layers[1].self_attn.q_a_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_load_state_dict_into_a_bf16_model(assign, state_dtype):
    source = _model()
    state = {k: v.to(state_dtype) if v.is_floating_point() else v for k, v in source.state_dict().items()}
    expected = {k: v.to(state_dtype).float() for k, v in _kept(source).items()}  # fp32 source: exact
    target = GLM5ForCausalLM(source.config).to(torch.bfloat16)
    target.load_state_dict(state, assign=assign)
    _assert_bit_equal(target, expected)


@pytest.mark.parametrize("model_dtype", LOW)
def test_glm52_bias_routes_a_low_precision_model_exactly_as_fp32(model_dtype):
    """256 experts, top-8, 4096 random tokens: every token picks the same 8 experts in the bf16 /
    fp16 model as in the fp32 one; with the bias rounded through bf16 most tokens pick another set."""
    fp32 = _model(n_routed_experts=256, num_experts_per_tok=8)
    low = _model(n_routed_experts=256, num_experts_per_tok=8).to(model_dtype)
    x = torch.randn(4096, fp32.config.hidden_size, generator=torch.Generator().manual_seed(7)).to(model_dtype)
    for layer in (1, 2, 3):
        ref_w, ref_idx, _ = fp32.model.layers[layer].mlp.gate(x.float())
        w, idx, _ = low.model.layers[layer].mlp.gate(x)
        assert torch.equal(idx, ref_idx) and torch.equal(w, ref_w)
    rounded = fp32.model.layers[1].mlp.gate
    ref_idx = rounded(x.float())[1]
    with torch.no_grad():
        rounded.e_score_correction_bias.copy_(rounded.e_score_correction_bias.bfloat16().float())
    assert rounded.e_score_correction_bias.unique().numel() <= 9  # 256 distinct values collapse to ~8
    other_set = (rounded(x.float())[1].sort(-1).values != ref_idx.sort(-1).values).any(-1).float().mean()
    assert other_set > 0.5, f"only {other_set:.1%} of tokens changed experts"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_and_indexer_weights_run_in_fp32_under_autocast(dtype):
    """Under CPU autocast (which runs a plain F.linear in `dtype`), the router, the indexer's
    weights_proj and k_norm give bit for bit what they give outside it; the index scores are fp32
    (wq_b and wk, ordinary projections, follow autocast as they follow the model dtype)."""
    model = _model()
    x = torch.randn(2, 20, model.config.hidden_size).to(dtype).float()
    gate, indexer = model.model.layers[1].mlp.gate, model.model.layers[0].self_attn.indexer
    k = torch.randn(2, 20, indexer.head_dim)
    ref = [*gate(x.flatten(0, 1)), indexer.weights_proj(x), indexer.k_norm(k)]
    from glm5lab.model.rope import rope_angles

    cos, sin = rope_angles(torch.arange(20), model.config.qk_rope_head_dim, model.config.rope_theta)
    q_lat = torch.randn(2, 20, model.config.q_lora_rank)
    ref_scores = indexer.scores(x, q_lat, indexer.keys(x, cos, sin), cos, sin)
    with torch.autocast("cpu", dtype=dtype):
        assert torch.nn.functional.linear(x, gate.weight).dtype == dtype  # autocast is on here
        got = [*gate(x.flatten(0, 1)), indexer.weights_proj(x), indexer.k_norm(k)]
        scores = indexer.scores(x, q_lat, indexer.keys(x, cos, sin), cos, sin)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert scores.dtype == torch.float32
    finite = ref_scores.isfinite()
    assert torch.equal(scores.isfinite(), finite)
    assert torch.allclose(scores[finite], ref_scores[finite], atol=0.05, rtol=0.05)


DRIVER = """
import sys
from pathlib import Path
import torch
from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.model.moe import Router
from glm5lab.model.precision import KeepFP32
from glm5lab.parallel import dist

ctx = dist.setup()
model = GLM5ForCausalLM(ModelConfig.from_preset("tiny"))
model.load_state_dict(torch.load(Path(sys.argv[1], "model.pt")))  # the test's `_model()`
before = {k: v.clone() for k, v in model.state_dict().items()}
seen = {}
def hook(name):
    def fn(m, args):
        seen[name] = {k: t.detach().clone() for k, t in list(m.named_parameters()) + list(m.named_buffers())}
    return fn
for name, m in model.named_modules():
    if isinstance(m, KeepFP32) or name.endswith("q_a_proj"):
        m.register_forward_pre_hook(hook(name))
dist.shard_model(model, ctx, param_dtype=torch.bfloat16)
ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(ctx.rank))
model(ids, mtp_depth=2).logits.float().sum().backward()
bad = []
for name, tensors in seen.items():
    for k, t in tensors.items():
        full = before[f"{name}.{k}"]
        if name.endswith("q_a_proj"):
            bad += [] if t.dtype == torch.bfloat16 else [f"{name}.{k} is {t.dtype}: mixed precision is off"]
        elif t.dtype != torch.float32 or not torch.equal(t, full):
            bad.append(f"{name}.{k}: {t.dtype}, max diff {(t.float() - full).abs().max():.3g}")
Path(sys.argv[1], f"rank{ctx.rank}.txt").write_text(f"{len(seen)} modules seen; bad: {bad}")
dist.teardown(ctx)
dist.end_process()  # leave as every multi-process run does
"""


def test_fsdp2_mixed_precision_feeds_the_forward_the_exact_fp32_values(tmp_path):
    """torchrun, 2 processes (gloo), `shard_model(param_dtype=bf16)`: inside the forward every
    kept module's unsharded tensors are fp32 and bit-equal to the model's before sharding, while
    the other weights are bf16 (mixed precision is on)."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    torch.save(_model().state_dict(), tmp_path / "model.pt")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={free_port()}", str(driver), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "15 modules seen; bad: []"
