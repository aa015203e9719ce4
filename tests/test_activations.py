"""`glm5lab.activations` against the truth: the bytes of the tensors autograd saves for the backward in a real
one-process training forward (`glm5lab.train.losses.stage_losses`, as `glm5lab train` runs it) of the tiny
preset and a variant without MTP and DSA, fp32 CPU, odd shapes, every attention route, with and without
activation checkpointing, in fp32 and in bf16 (CPU).

Measured: every tensor `saved_tensors_hooks` packs during the forward, each distinct storage once (by its data
pointer, its whole storage: a saved view holds its base), kept when it is still alive after the forward
(weak references: a branch whose graph is dropped, as the indexer keys the top-k selection reads, frees its
tensors), parameters and buffers excluded (ops save them by reference: they are weights, not activations).
With checkpointing the hooks see what the forward keeps (the head and each block's inputs); the backward then
recomputes one block at a time, whose saved tensors are measured without checkpointing: the step's peak is
the forward's plus the largest block's.
"""

import weakref

import pytest
import torch

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.activations import TOLERANCE, activations, cp_gather_bytes
from glm5lab.parallel.activation_checkpoint import apply_activation_checkpointing
from glm5lab.train.losses import stage_losses
from glm5lab.train.stages import Stage
from glm5lab.validate import torch_dtype

VARIANTS = {"tiny": {}, "tiny-no-mtp-no-dsa": dict(num_nextn_predict_layers=0, use_dsa=False),
            "tiny-fused-sdpa": dict(num_nextn_predict_layers=0, use_dsa=False, qk_nope_head_dim=8)}
"""tiny (MTP, DSA); without MTP and DSA (dense attention through SDPA's math fallback: q/k width 24, v 16); the
same with q/k width 16 = v width (SDPA's fused CPU kernel, as GLM-5's 256 = 256)."""
SHAPES = [(64, 2), (37, 1), (24, 3), (21, 5)]
"""(seq_len, batch): DSA's gathered route (T > 4 x index_topk = 32), odd; its masked route (8 < T <= 32); the
shortest modelled (20 tokens at MTP depth 1 and main, 18 at depth 3: above the decode kernels' 16); B x T stays
<= 128 tokens, so that no expert of the random router gets more than one 64-row tile (the formula assumes
balanced routing). The variant without DSA runs dense attention (SDPA's math fallback: tiny's q/k width 24 is
not its v width 16)."""


def _stage(cfg, T, B):
    dsa, mtp = cfg.use_dsa, (0.3,) * 3 if cfg.num_nextn_predict_layers else ()
    return Stage("sparse_adaptation" if dsa else "dense", 1, 1e-3, T, B, use_dsa=dsa, mtp_weights=mtp,
                 indexer_weight=1.0 if dsa else 0.0)


def measure(cfg, T, B, *, checkpointing=False, dtype="fp32"):
    """{part: bytes}: the saved tensors of one training forward by part ("head", "layer i", "mtp depth j"), the
    model in `dtype` (bf16: `.to(torch.bfloat16)`, the router, indexer weights_proj and k_norm kept fp32)."""
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).to(torch_dtype(dtype)).train()
    if checkpointing:
        apply_activation_checkpointing(model)
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    part, packed, depth = ["head"], [], [0]

    def enter_mtp(mod, args):
        depth[0] += 1
        part[0] = f"mtp depth {depth[0]}"

    for i, m in enumerate(model.model.layers):
        m.register_forward_pre_hook(lambda mod, args, i=i: part.__setitem__(0, f"layer {i}"))
        m.register_forward_hook(lambda mod, args, out: part.__setitem__(0, "head"))
    for m in model.model.mtp_layers:  # one part per depth: each call is one checkpointed region
        m.register_forward_pre_hook(enter_mtp)
        m.register_forward_hook(lambda mod, args, out: part.__setitem__(0, "head"))

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights and s.nbytes():
            packed.append((weakref.ref(t), s.data_ptr(), s.nbytes(), part[0]))
        return t

    window = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        losses = stage_losses(model, window, _stage(cfg, T, B))
    seen, out = set(), {}
    for ref, ptr, nbytes, where in packed:
        if ref() is not None and ptr not in seen:
            seen.add(ptr)
            out[where] = out.get(where, 0) + nbytes
    del losses
    return out


def formula(cfg, T, B, *, checkpointing=False, dtype="fp32"):
    return activations(cfg, seq_len=T, batch=B, dtype=dtype, use_dsa=cfg.use_dsa, indexer_loss=cfg.use_dsa,
                       checkpointing=checkpointing)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T,B", SHAPES)
def test_formula_equals_the_saved_tensors_of_a_training_forward(variant, T, B, dtype):
    cfg = ModelConfig.from_preset("tiny", **VARIANTS[variant])
    got, want = sum(measure(cfg, T, B, dtype=dtype).values()), formula(cfg, T, B, dtype=dtype)["total"]
    print(f"{variant} {dtype} T={T} B={B} checkpointing off: measured {got:,} formula {want:,.0f} "
          f"ratio {want / got:.4f}")
    assert abs(want / got - 1) <= TOLERANCE
    assert abs(formula(cfg, T + 8, B, dtype=dtype)["total"] / got - 1) > TOLERANCE  # a wrong shape fails
    other = "bf16" if dtype == "fp32" else "fp32"
    assert abs(formula(cfg, T, B, dtype=other)["total"] / got - 1) > TOLERANCE  # so does the wrong dtype


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T,B", SHAPES[:2])
def test_formula_with_activation_checkpointing(variant, T, B):
    cfg = ModelConfig.from_preset("tiny", **VARIANTS[variant])
    kept = measure(cfg, T, B, checkpointing=True)
    plain = measure(cfg, T, B)
    peak = max(v for k, v in plain.items() if k != "head")
    got, f = sum(kept.values()) + peak, formula(cfg, T, B, checkpointing=True)
    print(f"{variant} T={T} B={B} checkpointing on: measured {got:,} formula {f['total']:,.0f} "
          f"ratio {f['total'] / got:.4f}")
    assert abs(f["total"] / got - 1) <= TOLERANCE
    assert abs(f["recompute_peak"] / peak - 1) <= TOLERANCE
    assert f["total"] < 0.5 * formula(cfg, T, B)["total"]


def test_parts_and_refusals():
    cfg = ModelConfig.from_preset("glm5")
    a = activations(cfg, seq_len=4096, batch=1, cp=2, ep=8)
    assert len(a["layers"]) == cfg.num_hidden_layers and len(a["mtp"]) == 3
    assert {x["kind"] for x in a["layers"]} >= {"mla+own/dense", "mla+own/moe"}
    assert a["layers"][3]["cp_gathered"] > 0 and a["total"] == a["head"] + a["blocks"]
    g = cp_gather_bytes(cfg, 4)
    assert g["total"] == (512 + 64 + 128) * 2 * 3 / 4
    assert cp_gather_bytes(cfg, 1)["total"] == 0
    with pytest.raises(ValueError, match="seq_len = 4097 is not allowed: a multiple of cp = 2"):
        activations(cfg, seq_len=4097, batch=1, cp=2)
    with pytest.raises(ValueError, match="seq_len = 19 is not allowed: more than 19"):
        activations(cfg, seq_len=19, batch=1)
    with pytest.raises(ValueError, match="MLA attention layers only"):
        activations(ModelConfig.from_preset("glm4.5"), seq_len=64, batch=1)


def test_the_restated_kernel_constants_are_the_models():
    """The ledger imports no torch, so it restates three constants of the kernels it counts."""
    import inspect

    from glm5lab import activations as act
    from glm5lab.model import mla, moe, step

    assert act.GATHER_MIN_KEYS_PER_TOPK == mla.GATHER_MIN_KEYS_PER_TOPK
    assert act.DECODE_MAX_TOKENS == step.DECODE_MAX_TOKENS
    assert act.EXPERT_TILE == inspect.signature(moe.experts_grouped).parameters["tile"].default
