"""Expert parallelism on CPU with gloo: the all-to-all dispatcher against the single-process one,
and N processes (EP = 2, EP = 4, data 2 x expert 2) training exactly as one process does on the
same global batch, with skewed routing and at GLM-5's routing shape (256 experts, top-8), with Muon
orthogonalising each matrix (each expert, each head block) exactly once across the world.

Tolerance (fp32): losses within 1e-5 relative (the indexer KL, ~4e-5, a difference of nearly equal
log-probabilities, within 1e-7 absolute; observed 3e-9) and final weights within 1e-4 absolute. The ranks
sum gradients in another order than one process (FSDP2's reduce-scatter, the experts' gradients
arriving through the all-to-all's backward), and Muon's Newton-Schulz amplifies those last-bit
differences; observed: losses within 2e-7 relative, weights within 1e-5. The router bias moves by
exactly +-rate per step, so a routing decision that differed would show as a 1e-2 jump."""

import json
import os
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from glm5lab import ModelConfig
from glm5lab.model.dispatch import LocalDispatcher
from glm5lab.parallel import dist as gdist
from glm5lab.parallel.dist import end_process, session
from glm5lab.parallel.alltoall import check_ep
from glm5lab.parallel.context_parallel import check_mesh
from glm5lab.parallel.expert_parallel import AllToAllDispatcher, EPStats, pop_ep_metrics
from glm5lab.train.ep_check import HYPER, LR, ep_check_model, train_ep_check
from tests.conftest import free_port, write_word_corpus


@dataclass
class Case:
    """`ep_check_model`'s `overrides` and `skew`, and the run: `steps` steps of `batch` windows (global) of
    seq_len + 1 tokens."""

    name: str
    overrides: dict = field(default_factory=dict)
    skew: float = 0.0
    steps: int = 3
    batch: int = 4
    seq_len: int = 24

    def config(self) -> ModelConfig:
        return ModelConfig.from_preset("tiny", **{"vocab_size": 320, **self.overrides})


CASES = [Case("skew", skew=5.0), Case("glm5_routing", overrides=dict(n_routed_experts=256, num_experts_per_tok=8,
                                                                        moe_intermediate_size=8))]
MESHES = [(2, 2), (4, 4), (4, 2)]  # (processes, ep): EP = 2, EP = 4, data 2 x expert 2


def run(case: Case, ep: int = 1) -> dict:
    """Train `case` (`train_ep_check`) in this process (world 1) or on this rank of the initialised process group
    with expert-parallel size `ep`. Returns, on every rank: per step the losses (mean over ranks, with the step's
    gradient norm before clipping), the EP metrics, the per-rank routing loads load_RE (summed over the step's MoE
    forwards) and the matrices Newton-Schulz orthogonalised over the world (`ns_blocks`); and on rank 0 the final
    full state dict (`state`)."""
    ctx = gdist.setup() if dist.is_initialized() else gdist.DistContext(0, 1, torch.device("cpu"))
    model = ep_check_model(ctx, ep, case.overrides, case.skew)
    optimizer, blocks = HYPER.build_optimizer(model, LR), [0]
    optimizer.on_orthogonalize = lambda p, count: blocks.__setitem__(0, blocks[0] + count)
    g = torch.Generator().manual_seed(1)
    windows = list(torch.randint(0, 320, (case.steps, case.batch, case.seq_len + 1), generator=g))
    out = {"losses": [], "ep": [], "load_RE": [], "ns_blocks": []}

    def on_step(done, load_E):
        out["losses"].append({**gdist.mean_over_ranks(done.losses.to_log(), ctx), "grad_norm": done.grad_norm})
        out["ep"].append(pop_ep_metrics(model))
        out["load_RE"].append(_gather(load_E, ctx).tolist())
        out["ns_blocks"].append(int(_gather(torch.tensor(blocks.pop()), ctx).sum()))
        blocks.append(0)

    train_ep_check(model, ctx, windows, on_step, optimizer)
    full = gdist.full_model(model, ctx)
    if ctx.is_main:
        out["state"] = {k: v.detach().clone() for k, v in full.state_dict().items()}
    return out


def _gather(t: torch.Tensor, ctx) -> torch.Tensor:
    """Every rank's `t` (same shape on every rank), stacked in rank order: [world, *t.shape]."""
    if ctx.world_size == 1:
        return t[None]
    parts = [torch.zeros_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t)
    return torch.stack(parts)


def _spawn(worker, world: int, *args) -> None:
    """worker(rank, world, port, *args) in `world` spawned processes, a free port for their gloo group."""
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(world, free_port(), *args), nprocs=world, start_method="spawn")


def _worker(rank: int, world: int, port: int, ep: int, out_dir: str) -> None:
    """One rank of a spawned gloo group: run every case at `ep`; rank 0 saves the results."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with session():  # the groups left together, by every rank (`glm5lab.parallel.dist.teardown`)
        for case in CASES:
            result = run(case, ep)
            if rank == 0:
                torch.save(result, os.path.join(out_dir, f"{case.name}.pt"))
    end_process()  # leave as every multi-process run does


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return {case.name: run(case) for case in CASES}


@pytest.mark.parametrize("world,ep", [MESHES[0], pytest.param(*MESHES[1], marks=pytest.mark.slow), MESHES[2]],
                         ids=["ep2", "ep4", "dp2xep2"])  # ep4: 4 processes, 17 s: slow
def test_expert_parallel_trains_as_one_process(world, ep, reference, tmp_path):
    _spawn(_worker, world, ep, str(tmp_path))
    for case in CASES:
        one, many = reference[case.name], torch.load(tmp_path / f"{case.name}.pt")
        for a, b in zip(one["losses"], many["losses"], strict=True):
            for key in ("loss", "lm_loss", "grad_norm"):  # Muon's update ignores a gradient's scale: the norm does not
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (case.name, key, a[key], b[key])
            assert abs(a["indexer_kl"] - b["indexer_kl"]) <= 1e-7, (case.name, a["indexer_kl"], b["indexer_kl"])
            assert a["mtp_losses"] == pytest.approx(b["mtp_losses"], rel=1e-5)
        assert one["state"].keys() == many["state"].keys()
        worst = max((float((one["state"][k] - many["state"][k]).abs().max()), k) for k in one["state"])
        assert worst[0] < 1e-4, (case.name, worst)
        bias = [k for k in one["state"] if k.endswith("e_score_correction_bias")]
        assert bias and all(one["state"][k].abs().max() > 0 for k in bias)  # the balancing moved the bias
        _check_metrics(case, many, world, ep)
        assert many["ns_blocks"] == one["ns_blocks"] == [_muon_blocks(case)] * case.steps


def _muon_blocks(case: Case) -> int:
    """Matrices Muon Split orthogonalises in a step: one per head of a split matrix, one per routed
    expert, one per other Muon matrix (`glm5lab.optim.groups`)."""
    from glm5lab.optim import param_group_table

    model = ep_check_model(gdist.DistContext(0, 1, torch.device("cpu")), 1, case.overrides, case.skew)
    shapes = dict(model.named_parameters())
    return sum(row.heads if row.kind == "muon_split" else shapes[row.name].shape[0] if shapes[row.name].ndim == 3 else 1
               for row in param_group_table(model, "muon-split") if row.kind != "adamw")


def _check_metrics(case: Case, result: dict, world: int, ep: int) -> None:
    """ep_tokens counts every routed row once; a2a_bytes equals the ledger's formula on the step's
    routing counts (fp32 rows of hidden_size values, forward and backward), exactly."""
    from glm5lab.parallel.alltoall import a2a_bytes

    cfg = case.config()
    for metrics, load_RE in zip(result["ep"], result["load_RE"], strict=True):
        assert len(load_RE) == world and sum(metrics["ep_tokens"]) == sum(map(sum, load_RE))
        assert metrics["a2a_bytes"] == a2a_bytes(load_RE, ep, cfg.hidden_size, "fp32")
        assert metrics["ep_imbalance"] == max(metrics["ep_tokens"]) * ep / sum(metrics["ep_tokens"])
        if case.skew:  # experts 0 and 1 (EP rank 0) take every row: the other EP ranks receive none
            assert metrics["ep_tokens"][1:] == [0] * (ep - 1) and metrics["ep_imbalance"] == ep


def _dispatch_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with session():  # the groups left together, by every rank (`glm5lab.parallel.dist.teardown`)
        results = [_dispatch_roundtrip(rank, world, routing) for routing in ("random", "rank0", "empty_rank")]
        torch.save(results, os.path.join(out_dir, f"dispatch-{rank}.pt"))
    end_process()  # leave as every multi-process run does


E, K, D = 6, 2, 5


def _inputs(rank: int, routing: str):
    """This rank's tokens (odd counts; none on rank 2 for "empty_rank") and their routing: random,
    or every row to experts 0 and 1 (EP rank 0; experts 2..5 and ranks 1, 2 receive nothing)."""
    g = torch.Generator().manual_seed(10 + rank)
    N = 0 if (routing == "empty_rank" and rank == 2) else 3 + 2 * rank
    x_ND = torch.randn(N, D, generator=g, dtype=torch.float64)
    idx_NK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)]) if N else torch.zeros(0, K, dtype=torch.long)
    if routing != "random":
        idx_NK = torch.tensor([[0, 1]] * N, dtype=torch.long).view(N, K)
    w_NK = torch.rand(N, K, generator=g, dtype=torch.float64)
    return x_ND, idx_NK, w_NK


def _expert_fn(x_RD, counts_L, first_expert):
    """Row through 'expert e': x * (e + 1), so a row that reached the wrong expert shows."""
    e_R = torch.repeat_interleave(torch.arange(counts_L.shape[0]) + first_expert, counts_L)
    return x_RD * (e_R + 1).to(x_RD.dtype)[:, None]


def _dispatch_roundtrip(rank: int, world: int, routing: str):
    x_ND, idx_NK, w_NK = _inputs(rank, routing)
    x_ND.requires_grad_(True)
    dispatcher = AllToAllDispatcher(dist.group.WORLD, world, rank, EPStats())
    x_RD, counts_L, sent = dispatcher.dispatch(x_ND, idx_NK, w_NK, E)
    y_ND = dispatcher.combine(_expert_fn(x_RD, counts_L, rank * (E // world)), sent, x_ND.dtype)
    grad_ND = torch.arange(y_ND.numel(), dtype=y_ND.dtype).view_as(y_ND) + 1
    y_ND.backward(grad_ND)
    return {"y": y_ND.detach(), "grad": x_ND.grad.clone(), "counts": counts_L, "load": sent.load_E}


def test_dispatch_and_combine_across_ranks_equal_one_process(tmp_path):
    """3 ranks, 6 experts (2 per rank), fp64: forward and backward of dispatch -> expert -> combine
    equal the single-process dispatcher's on each rank's tokens, exactly; with odd token counts,
    experts and ranks that receive no rows, and a rank that sends none."""
    _spawn(_dispatch_worker, 3, str(tmp_path))
    for rank in range(3):
        got = torch.load(tmp_path / f"dispatch-{rank}.pt")
        for routing, result in zip(("random", "rank0", "empty_rank"), got, strict=True):
            x_ND, idx_NK, w_NK = _inputs(rank, routing)
            x_ND.requires_grad_(True)
            local = LocalDispatcher()
            x_AD, counts_E, sent = local.dispatch(x_ND, idx_NK, w_NK, E)
            y_ND = local.combine(_expert_fn(x_AD, counts_E, 0), sent, x_ND.dtype)
            y_ND.backward(torch.arange(y_ND.numel(), dtype=y_ND.dtype).view_as(y_ND) + 1)
            assert torch.allclose(result["y"], y_ND.detach(), rtol=1e-12, atol=1e-12), (rank, routing)
            assert torch.allclose(result["grad"], x_ND.grad, rtol=1e-12, atol=1e-12), (rank, routing)
            assert torch.equal(result["load"], sent.load_E)
            if routing != "random":  # every token's 2 rows go to experts 0 and 1, on rank 0
                total = 3 + 5 + (7 if routing == "rank0" else 0)
                assert result["counts"].tolist() == ([total, total] if rank == 0 else [0, 0])


def test_ep_refusals():
    """What --ep asks of the model (`check_ep`; the run's process count is `check_mesh`'s, below), and the GPU
    count a ledger names."""
    tiny, dense = ModelConfig.from_preset("tiny"), ModelConfig.from_preset("tiny", first_k_dense_replace=4)
    cases = [
        ((4, 6, tiny), r"a divisor of 6 GPUs"),
        ((3, None, tiny), r"a divisor of the routed experts, n_routed_experts = 8"),
        ((2, None, dense), r"1 for a model without MoE layers \(n_routed_experts 8, mlp_layer_types \['dense'\]\)"),
        ((0, 2, tiny), r"an integer >= 1"),
    ]
    for (ep, world, cfg), rule in cases:
        with pytest.raises(ValueError, match=rf"^--ep = {ep} is not allowed: {rule}$"):
            check_ep(ep, world, cfg)
    check_ep(1, 1, dense)  # no EP: nothing to check
    with pytest.raises(ValueError, match=r"^--cp 1 x --ep 2 = 2 does not divide the run's 1 process \(the "
                                         r"world is dp x cp x ep ranks\): start it under torchrun "
                                         r"--nproc-per-node 2 \(or a multiple of 2\)$"):
        check_mesh(1, 1, 2)
    assert [check_mesh(w, cp, ep) for w, cp, ep in ((8, 2, 2), (4, 1, 4), (6, 3, 1))] == [2, 1, 2]


def test_ep_run_resumes_bit_exactly_and_a_checkpoint_starts_one(tmp_path, monkeypatch):
    """`glm5lab train --ep 2` under torchrun, stopped after step 2 of a dense stage (the DSA indexer has no
    gradient there, so no optimizer state) and resumed: the final weights equal the uninterrupted run's
    bit for bit. Then `--init` of the finished run's HF folder (RUN/model, read tensor by tensor into each rank's
    shards) starts an EP run whose first step (loss, gradient norm) equals one process's `--init` of the same
    weights' run checkpoint (DCP) on the same global batch."""
    import shutil
    import subprocess
    import sys

    from glm5lab import GLM5ForCausalLM
    from glm5lab.train.loop import TrainArgs
    from glm5lab.train.loop import train as train_here

    def train(out, *extra, model=("--preset", "tiny"), steps="3"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               "-m", "glm5lab", "train", *model, "--ep", "2", "--stages", "dense", "--steps", steps,
               "--seq-len", "24", "--batch-size", "2", "--eval-every", "0", "--checkpoint-every", "1",
               "--no-progress", "--data", str(corpus), "--out", str(out), *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLM5LAB_CACHE": str(tmp_path / "cache")}
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]

    corpus = tmp_path / "texts"
    write_word_corpus(corpus)
    train(tmp_path / "whole")
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)
    (cut / "summary.json").unlink()
    shutil.rmtree(cut / "checkpoints" / "step-000003")
    (cut / "checkpoints" / "latest").write_text("step-000002\n")
    train(cut, "--resume")
    a, b = (GLM5ForCausalLM.from_pretrained(run / "checkpoints" / "step-000003").state_dict()  # sharded (DCP)
            for run in (tmp_path / "whole", cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    train(tmp_path / "init-ep", model=("--init", str(tmp_path / "whole" / "model")), steps="1")
    monkeypatch.setenv("GLM5LAB_CACHE", str(tmp_path / "cache"))
    init = str(tmp_path / "whole" / "checkpoints" / "step-000003")
    train_here(TrainArgs(init=init, data=str(corpus), out=str(tmp_path / "init-one"), stages=["dense"], steps=1,
                         seq_len=24, batch_size=4, eval_every=0, checkpoint_every=1, progress=False))
    ep_row, one_row = (json.loads((tmp_path / run / "metrics.jsonl").read_text()) for run in ("init-ep", "init-one"))
    for key in ("loss", "lm_loss", "grad_norm"):
        assert abs(ep_row[key] - one_row[key]) <= 1e-5 * abs(one_row[key]), (key, ep_row[key], one_row[key])
