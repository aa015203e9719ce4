"""MuonAdamW on FSDP2 and expert-parallel shards (gloo, CPU): the same params as one process, each Newton-Schulz
block computed exactly once in the world, one gather and one scatter per shape group of gathered matrices, no
all-gather. One `torch.distributed.run` launch of 4 processes
(tests/optim/muon_dist_driver.py) covers sharding over 4 ranks and over 2 ranks (two copies of 2).

Tolerance: PARAM_ATOL 2e-7 max abs on params (~0.02) after 3 fp32 steps; observed 0 (bit-exact) at n = 2 and 4
on a 2-core CPU. A gathered matrix is orthogonalised whole by the same kernels as in one process, and the
elementwise updates are the same ops; a local shard of experts or heads is a smaller batch [e, M, N] through the
same batched GEMMs, which another BLAS may round differently by batch size, as test_muon.py's EXPERT_ATOL (2e-7)
allows for. Garbage must fail: "mat" orthogonalised per rank's rows instead (what skipping the gather would do)
is >= 7e-3 away (observed 7.6e-3 at n=2, 9.5e-3 at n=4; asserted > 5e-3).
"""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import free_port

PARAM_ATOL = 2e-7
# name -> blocks per step (experts, heads or 1), route at n=2, route at n=4 (L local, G gathered to one owner)
TABLE = {
    "mat": (1, "G", "G"),  # [8, 5] "muon": rows split over ranks
    "mat_odd": (1, "G", "G"),  # [5, 6] "muon": uneven rows, an empty shard at n=4
    "mat_twin": (1, "G", "G"),  # [8, 5] "muon", the shape of "mat": one shape group with it
    "experts": (3, "L", "L"),  # [3, 6, 4] Shard(0) on a 1-D mesh; an empty shard at n=4
    "ep_experts": (6, "L", "L"),  # [6, 4, 6] EP Shard(0) under FSDP2: (_StridedShard(0), Shard(0))
    "split_even": (4, "L", "L"),  # [8, 6] 4 heads of 2 rows; chunk 4 or 2 rows
    "split_uneven": (3, "G", "L"),  # [6, 5] 3 heads of 2 rows; chunk 3 (straddles) or 2 (an empty shard at n=4)
    "split_straddle": (5, "G", "G"),  # [10, 4] 5 heads of 2 rows; chunk 5 or 3 rows: straddles
    "split_kv": (8, "L", "L"),  # [12, 6] 4 heads of 3 rows cut (2, 1) ("muon-split-kv"); chunk 6 or 3 rows
    "split_kv_straddle": (10, "G", "G"),  # [15, 4] 5 heads of 3 rows cut (1, 2); chunk 8 or 4 rows: straddles
}


TWINS = {"mat_twin": "mat"}
"""A gathered param -> the earlier one of the same global shape: they share a shape group (one gather, one scatter,
one owner)."""


def _route(name: str, n: int) -> str:
    return TABLE[name][1 if n == 2 else 2]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("muon_dist") / "out.json"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
                          f"--master_port={free_port()}", "tests/optim/muon_dist_driver.py", str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return {int(n): ranks for n, ranks in json.loads(out.read_text()).items()}


def _worlds(ranks: list[dict], n: int) -> list[list[dict]]:
    """The groups of n ranks that shard together (n=2: ranks {0, 1} and {2, 3}), each in mesh-rank order."""
    return [ranks[i:i + n] for i in range(0, len(ranks), n)]


def _gathered(n: int) -> list[str]:
    return [name for name in TABLE if _route(name, n) == "G"]


@pytest.mark.parametrize("n", [2, 4])
def test_sharded_steps_equal_one_process(cases, n):
    for rank in cases[n]:
        assert max(rank["err"].values()) <= PARAM_ATOL, rank["err"]
        assert rank["garbage"] > 5e-3  # per-shard NS of "mat" (no gather) is far from the reference
        assert rank["buffers"] == dict.fromkeys(TABLE, "DTensorTrue")  # momentum stays sharded like the param
        assert rank["state_keys"] == ["exp_avg", "exp_avg_sq", "momentum_buffer", "step"]
        assert "Muon on a DTensor needs" in rank["bad_layout"] and "Replicate()" in rank["bad_layout"]


@pytest.mark.parametrize("n", [2, 4])
def test_each_block_is_orthogonalised_once(cases, n):
    """Every step, each expert / head block / matrix is orthogonalised by exactly one rank of its world: local
    blocks by the rank holding them, a gathered matrix whole by its owner alone (mesh rank k mod n for the k-th
    shape group of gathered matrices)."""
    owners = _owners(n)
    for world in _worlds(cases[n], n):
        for step in range(3):
            for name, (blocks, _, _) in TABLE.items():
                counts = [rank["counts"][step].get(name, 0) for rank in world]
                assert sum(counts) == blocks, (name, counts)
                if _route(name, n) == "L":
                    assert counts == [rank["blocks"][name] for rank in world], (name, counts)
                else:
                    assert counts == [blocks if r == owners[name] else 0 for r in range(n)], (name, counts)
    assert len(set(owners.values())) == min(n, len(owners))  # owners take turns


def _owners(n: int) -> dict[str, int]:
    """Gathered param -> owner mesh rank: k mod n for the k-th shape group (a twin: its twin's)."""
    owners, groups = {}, 0
    for name in _gathered(n):
        if name in TWINS:
            owners[name] = owners[TWINS[name]]
        else:
            owners[name], groups = groups % n, groups + 1
    return owners


@pytest.mark.parametrize("n", [2, 4])
def test_only_gathered_matrices_communicate(cases, n):
    """Per step and rank: one gather and one scatter per shape group of gathered matrices, nothing else (no
    all-gather, nothing for local experts or heads); an optimizer over local-path params only issues no
    collective at all."""
    g = len(_gathered(n)) - len(TWINS)
    for rank in cases[n]:
        assert rank["comms"] == [{"c10d.gather_": g, "c10d.scatter_": g}] * 3
        assert rank["local_comm"] == 0
