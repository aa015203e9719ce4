"""Driver for test_muon_dist.py, run as `python -m torch.distributed.run --nproc_per_node=4 THIS out.json` (gloo,
CPU). Every rank builds the same full params and grads, steps one process's MuonAdamW on the plain tensors (the
reference), then the same optimizer on an FSDP2 model that holds them as shards over n ranks: the root's params
Shard(0) on a 1-D mesh of the n ranks, `moe.ep_experts` in the expert-parallel layout (Shard(0) over "ep", then
FSDP2 over "dp" on a ("dp", "ep") mesh). Case n=4 shards over all four ranks ((dp, ep) = (2, 2)); case n=2 runs
two independent copies, ranks {0, 1} and {2, 3}, each on its own 2-rank ("dp", "ep") = (1, 2) mesh (so the
optimizer must use the mesh's group and mesh ranks, not the world's). Rank 0 writes what every rank observed
(errors, Newton-Schulz counts, collectives) to out.json."""

import json
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from glm5lab.optim import MuonAdamW
from glm5lab.parallel.dist import end_process, session

# name -> (shape, kind, heads); ep_experts lives on the "moe" submodule (the EP layout), the rest on the root
PARAMS = {
    "mat": ((8, 5), "muon", None),
    "mat_odd": ((5, 6), "muon", None),
    "mat_twin": ((8, 5), "muon", None),  # the shape of "mat": gathered with it, one collective for both
    "experts": ((3, 6, 4), "muon", None),
    "ep_experts": ((6, 4, 6), "muon", None),
    "split_even": ((8, 6), "muon_split", 4),
    "split_uneven": ((6, 5), "muon_split", 3),
    "split_straddle": ((10, 4), "muon_split", 5),
    "split_kv": ((12, 6), "muon_split", 4),
    "split_kv_straddle": ((15, 4), "muon_split", 5),
    "bias": ((5,), "adamw", None),
}
SECTIONS = {"split_kv": (2, 1), "split_kv_straddle": (1, 2)}
"""Group key `sections` ("muon-split-kv": each head's rows cut into K and V sections, each orthogonalised)."""
LOCAL_AT_ANY_N = ("experts", "ep_experts", "split_even", "split_kv")
STEPS, LR = 3, 0.02


def _groups(params: dict, kinds: dict) -> list[dict]:
    """One param group per (kind, heads, sections), in PARAMS order (which fixes the gather owners' round-robin)."""
    groups: dict[tuple, dict] = {}
    for name, p in params.items():
        kind, heads = kinds[name]
        sections = SECTIONS.get(name) if kind == "muon_split" else None
        group = groups.setdefault((kind, heads, sections), {"params": [], "kind": kind, "heads": heads,
                                                            "sections": sections})
        group["params"].append(p)
    return list(groups.values())


def _reference(full: dict, grads: list[dict], kinds: dict) -> dict:
    params = {k: nn.Parameter(v.clone()) for k, v in full.items()}
    opt = MuonAdamW(_groups(params, kinds), lr=LR)
    for step_grads in grads:
        for k, p in params.items():
            p.grad = step_grads[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def _sharded_model(full: dict, n: int) -> dict:
    if n == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    else:
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("copy", "dp", "ep"))["dp", "ep"]
    model = nn.Module()
    model.moe = nn.Module()
    for k, v in full.items():
        if k == "ep_experts":
            model.moe.ep_experts = nn.Parameter(distribute_tensor(v.clone(), mesh["ep"], [Shard(0)]))
        else:
            model.register_parameter(k, nn.Parameter(v.clone()))
    fully_shard(model.moe, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh._flatten(f"shard{n}"))
    return {k: model.moe.ep_experts if k == "ep_experts" else getattr(model, k) for k in full}


def _set_grads(params: dict, grads: dict) -> None:
    for k, p in params.items():
        mesh = p.device_mesh
        p.grad = distribute_tensor(grads[k], mesh, [Replicate()] * mesh.ndim).redistribute(mesh, p.placements)


def _local_blocks(p: DTensor, kind: str, heads: int | None, sections: int = 1) -> int:
    """Newton-Schulz matrices of the local shard: experts, heads x sections per head, or the whole matrix."""
    rows = p.to_local().shape[0]
    return rows if p.ndim == 3 else rows // (p.shape[0] // heads if kind == "muon_split" else p.shape[0]) * sections


def run_case(n: int) -> dict:
    """What this rank observes sharding over n ranks (4, or 2 in two copies)."""
    g = torch.Generator().manual_seed(0)
    full = {k: torch.randn(shape, generator=g) * 0.02 for k, (shape, _, _) in PARAMS.items()}
    grads = [{k: torch.randn(shape, generator=g) for k, (shape, _, _) in PARAMS.items()} for _ in range(STEPS)]
    kinds = {k: (kind, heads) for k, (_, kind, heads) in PARAMS.items()}
    ref = _reference(full, grads, kinds)
    # garbage: "mat" orthogonalised per rank's rows (8 rows split evenly), what a gather-free step would compute
    per_shard = _reference(full, grads, {**kinds, "mat": ("muon_split", n)})

    params = _sharded_model(full, n)
    names = {id(p): k for k, p in params.items()}
    counts: list[Counter] = []
    opt = MuonAdamW(_groups(params, kinds), lr=LR,
                    on_orthogonalize=lambda p, count: counts[-1].update({names[id(p)]: count}))
    comms = []
    for step_grads in grads:
        _set_grads(params, step_grads)
        counts.append(Counter())
        with CommDebugMode() as comm:
            opt.step()
        comms.append({str(op): c for op, c in comm.get_comm_counts().items()})
    err = {k: float((p.full_tensor() - ref[k]).abs().max()) for k, p in params.items()}
    garbage = float((params["mat"].full_tensor() - per_shard["mat"]).abs().max())
    buffers = {k: type(opt.state[p]["momentum_buffer"]).__name__ + str(opt.state[p]["momentum_buffer"].placements
                                                                          == p.placements)
               for k, p in params.items() if PARAMS[k][1] != "adamw"}
    state_keys = sorted({key for s in opt.state_dict()["state"].values() for key in s})

    local = {k: params[k] for k in LOCAL_AT_ANY_N}
    local_opt = MuonAdamW(_groups(local, kinds), lr=LR)
    with CommDebugMode() as comm:
        local_opt.step()
    local_comm = comm.get_total_counts()

    bad = nn.Parameter(distribute_tensor(torch.randn(4, 3), params["mat"].device_mesh, [Replicate()]))
    bad.grad = torch.ones_like(bad)
    try:
        MuonAdamW([{"params": [bad], "kind": "muon"}]).step()
        bad_layout = None
    except ValueError as e:
        bad_layout = str(e)

    return {"counts": [dict(c) for c in counts], "comms": comms, "err": err, "garbage": garbage,
            "blocks": {k: _local_blocks(params[k], kind, heads, len(SECTIONS.get(k, (0,))))
                       for k, (kind, heads) in kinds.items() if kind != "adamw"},
            "buffers": buffers, "state_keys": state_keys, "local_comm": local_comm, "bad_layout": bad_layout}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    with session():  # every rank leaves the groups together (barrier, destroy, collect): glm5lab.parallel.dist.teardown
        assert dist.get_world_size() == 4, "run with --nproc_per_node=4"
        cases = {}
        for n in (4, 2):
            cases[n] = [None] * 4
            dist.all_gather_object(cases[n], run_case(n))
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(cases, f)


if __name__ == "__main__":
    main(sys.argv[1])
    end_process()  # not the interpreter's exit, which tears down the (still referenced) gloo groups in no fixed order
