"""Driver of tests/model/test_cp_activations.py: run under `torchrun --nproc_per_node=N` (gloo, CPU).

For each case, every rank measures the tensors autograd saves in its CP share of a training forward
(`stage_losses(..., context_parallel=cp)`, tiny preset without MTP, fp32, head_tail layout) as
tests/test_activations.py measures one process's (saved_tensors_hooks, each distinct storage once, alive after the
forward, parameters and buffers excluded), and prints one line "rank R case C: measured M formula F one F1" with
F = `glm5lab.activations.activations(cfg, seq_len=T, batch=B, cp=N)["total"]` and F1 the same at cp = 1 (what
the formula would say without CP: must be far off). argv: cases "variant:T:B" (variant dsa | dense).
"""

import sys
import weakref

import torch
import torch.distributed as dist

from glm5lab import GLM5ForCausalLM
from glm5lab.activations import activations
from glm5lab.config import ModelConfig
from glm5lab.parallel.context_parallel import ContextParallel
from glm5lab.parallel.dist import end_process, teardown
from glm5lab.train.losses import stage_losses
from glm5lab.train.stages import Stage

VARIANTS = {"dsa": dict(num_nextn_predict_layers=0),
            "dense": dict(num_nextn_predict_layers=0, use_dsa=False)}


def saved_bytes(model, window, stage, cp) -> int:
    """Bytes of the distinct storages autograd saved in this rank's forward and still alive after it."""
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    packed = []

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in weights and s.nbytes():
            packed.append((weakref.ref(t), s.data_ptr(), s.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        losses = stage_losses(model, window, stage, context_parallel=cp)
    seen, total = set(), 0
    for ref, ptr, nbytes in packed:
        if ref() is not None and ptr not in seen:
            seen.add(ptr)
            total += nbytes
    del losses
    return total


def main():
    dist.init_process_group("gloo")
    for case in sys.argv[1:]:
        variant, T, B = case.split(":")
        run_case(case, variant, int(T), int(B))
    teardown()
    end_process()


def run_case(case: str, variant: str, T: int, B: int) -> None:
    cfg = ModelConfig.from_preset("tiny", **VARIANTS[variant])
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg).train()
    cp = ContextParallel(dist.group.WORLD)
    dsa = cfg.use_dsa
    stage = Stage("sparse" if dsa else "dense", 1, 1e-3, T, B, use_dsa=dsa, mtp_weights=(),
                  indexer_weight=1.0 if dsa else 0.0)
    window = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    got = saved_bytes(model, window, stage, cp)
    want, one = (activations(cfg, seq_len=T, batch=B, dtype="fp32", use_dsa=dsa, indexer_loss=dsa, cp=c)["total"]
                 for c in (cp.size, 1))
    print(f"rank {cp.rank} case {case}: measured {got} formula {want:.0f} one {one:.0f}", flush=True)


if __name__ == "__main__":
    main()
