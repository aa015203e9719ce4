"""Driver of tests/model/test_context_parallel.py: run under `torchrun --nproc_per_node=N` (gloo, CPU).

Every rank builds the same tiny GLM-5 (MLA, DSA top-8 below the length, a shared IndexCache layer, MTP) and the
same batch, runs one process's forward and backward itself (the reference), then the CP forward of its tokens,
and compares, stage by stage (dense, indexer warm-up, sparse adaptation, and dense with indexer weight 0):
logits and hidden states at its positions, every DSA top-k (exact), each loss (the mean over ranks of its share),
every parameter's gradient (averaged over ranks, as FSDP2's reduce-scatter does) and the grad norm; then three
optimizer steps from the same weights; and the forward gathers' bytes against `activations.cp_gather_bytes`.
Exits non-zero with the first mismatch on stderr. argv: layout, sequence length, attention kind (mla|gqa).
"""

import copy
import sys

import torch
import torch.distributed as dist

from glm5lab import GLM5ForCausalLM
from glm5lab.activations import cp_gather_bytes
from glm5lab.config import ModelConfig
from glm5lab.model.mla import MLAttention
from glm5lab.optim import build_optimizer
from glm5lab.parallel.context_parallel import ContextParallel
from glm5lab.parallel.dist import end_process, teardown
from glm5lab.train.losses import stage_losses
from glm5lab.train.stages import Stage
from glm5lab.train.step import set_trainable

TOL = 2e-5  # fp32: the same sums over other batch shapes (local queries, gathered keys) round differently


def close(name, a, b, tol=TOL):
    err = float((a - b).abs().max()) if a.numel() else 0.0
    scale = max(1.0, float(b.abs().max()) if b.numel() else 0.0)
    if not err <= tol * scale:
        raise AssertionError(f"{name}: max |cp - one| = {err:.3g} (scale {scale:.3g}, tol {tol})")


def record_topk(model):
    """Wrap every MLA layer's `select` to record the top-k it returns (in call order)."""
    seen = []
    for m in model.modules():
        if isinstance(m, MLAttention):
            def select(*args, _orig=m.select, **kw):
                out = _orig(*args, **kw)
                seen.append(out)
                return out
            m.select = select
    return seen


def averaged_grads(model, cp):
    out = {}
    for name, p in model.named_parameters():
        g = None if p.grad is None else p.grad.clone()
        if g is not None:
            dist.all_reduce(g)
            g /= cp.size
        out[name] = g
    return out


def compare_stage(stage, model, ref, window, cp):
    positions = cp.positions(window.shape[1] - 1)
    for m in (model, ref):
        set_trainable(m, stage)
        m.zero_grad(set_to_none=True)
    ref_topk, cp_topk = record_topk(ref), record_topk(model)
    one = stage_losses(ref, window, stage)
    one.total.backward()
    mine = stage_losses(model, window, stage, context_parallel=cp)
    mine.total.backward()
    for name, a, b in (("total", mine.total, one.total), ("lm", mine.lm, one.lm), ("indexer", mine.indexer, one.indexer),
                       *((f"mtp{j}", a, b) for j, (a, b) in enumerate(zip(mine.mtp, one.mtp, strict=True)))):
        if (a is None) != (b is None):
            raise AssertionError(f"{stage.name} loss {name}: cp {a} vs one {b}")
        if a is not None:
            a = a.detach().clone()
            dist.all_reduce(a)
            close(f"{stage.name} loss {name}", a / cp.size, b.detach())
    if len(cp_topk) != len(ref_topk):
        raise AssertionError(f"{stage.name}: {len(cp_topk)} selections under CP, {len(ref_topk)} in one process")
    for i, (a, b) in enumerate(zip(cp_topk, ref_topk, strict=True)):
        if (a is None) != (b is None):
            raise AssertionError(f"{stage.name} selection {i}: DSA ran in one and not the other")
        if a is None:
            continue
        n = a.idx_BTK.shape[1]  # MTP depths: this rank's first n tokens
        if not (torch.equal(a.idx_BTK, b.idx_BTK[:, positions[:n]]) and torch.equal(a.valid_BTK, b.valid_BTK[:, positions[:n]])):
            raise AssertionError(f"{stage.name} selection {i}: top-k indices differ from one process's")
    grads = averaged_grads(model, cp)
    for name, p in ref.named_parameters():
        if (grads[name] is None) != (p.grad is None):
            raise AssertionError(f"{stage.name} grad {name}: cp {'None' if grads[name] is None else 'set'}, one "
                                 f"{'None' if p.grad is None else 'set'}")
        if p.grad is not None:
            close(f"{stage.name} grad {name}", grads[name], p.grad, tol=1e-4)
    norms = [torch.stack([g.norm() for g in gs if g is not None]).norm()
             for gs in (grads.values(), [p.grad for p in ref.parameters()])]
    close(f"{stage.name} grad norm", norms[0], norms[1])
    return sum(t is not None for t in ref_topk)


def check_forward(model, ref, ids, cp, use_dsa):
    with torch.no_grad():
        one = ref(ids, use_dsa=use_dsa)
        cp.gathered_bytes = 0
        mine = model(ids, use_dsa=use_dsa, context_parallel=cp)
    positions = cp.positions(ids.shape[1])
    close("logits", mine.logits, one.logits[:, positions])
    close("hidden", mine.hidden_states, one.hidden_states[:, positions])
    return cp.gathered_bytes


def main():
    layout, T, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    extra = dict(attention_types=["mla", "mla", "gqa", "gqa"], num_key_value_heads=2) if kind == "gqa" else {}
    cfg = ModelConfig.from_preset("tiny", **{"use_dsa": True, "num_nextn_predict_layers": 1, **extra})
    ref = GLM5ForCausalLM(cfg)
    model = copy.deepcopy(ref)
    cp = ContextParallel(dist.group.WORLD, layout)
    B = 2
    window = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    gathered = check_forward(model, ref, window[:, :-1], cp, use_dsa=cfg.use_dsa)
    per_token = cp_gather_bytes(cfg, cp.size, dtype="fp32")
    mla = sum(s.attention == "mla" for s in model.layer_specs)
    own = sum(s.indexer == "own" for s in model.layer_specs) if cfg.use_dsa and T > cfg.index_topk else 0
    gqa = len(model.layer_specs) - mla  # GQA gathers its K and V heads: G (X + V) values per token
    gqa_bytes = cfg.num_key_value_heads * (cfg.qk_head_dim + cfg.v_head_dim) * 4 * (cp.size - 1) / cp.size
    expect = B * T * (mla * per_token["latent"] + own * per_token["indexer_keys"] + gqa * gqa_bytes)
    if round(expect) != gathered:
        raise AssertionError(f"gathered {gathered} bytes, the ledger says {expect}")
    stages = [Stage("dense", 1, 1e-3, T, B, indexer_weight=0.0),
              Stage("indexer_warmup", 1, 1e-3, T, B, trainable="indexer", lm_weight=0.0, mtp_weights=(0.3,),
                    indexer_weight=1.0),
              Stage("sparse", 1, 1e-3, T, B, use_dsa=True, indexer_weight=1.0)]
    selections = [compare_stage(st, model, ref, window, cp) for st in stages]
    if kind == "mla" and T > cfg.index_topk and not selections[2]:
        raise AssertionError("the sparse stage ran no DSA selection")
    # three optimizer steps of the sparse stage from the same weights, gradients averaged over the group
    sparse = stages[2]
    opts = [build_optimizer(m, "muon", lr=1e-2, weight_decay=0.1) for m in (model, ref)]
    for _ in range(3):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        stage_losses(ref, window, sparse).total.backward()
        stage_losses(model, window, sparse, context_parallel=cp).total.backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= cp.size
        for opt in opts:
            opt.step()
    ref_state = ref.state_dict()
    for name, value in model.state_dict().items():
        close(f"weights after 3 steps: {name}", value, ref_state[name], tol=1e-4)
    print(f"rank {cp.rank}: ok ({layout}, T={T}, {kind}, selections {selections}, gathered {gathered} bytes)")
    teardown()
    end_process()


if __name__ == "__main__":
    main()
