"""A few training steps of a tiny MoE model in one process or under expert parallelism (gloo, CPU),
for `test_expert_parallel.py` and `benchmarks/expert_parallel.py`: the same seeded model and global
batch, each rank training on its contiguous slice of the batch."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.parallel import dist as gdist
from glm5lab.parallel.expert_parallel import pop_ep_metrics
from glm5lab.train.losses import stage_losses
from glm5lab.train.stages import Stage
from glm5lab.train.recipe import TrainHyper
from glm5lab.train.step import optimizer_step, set_trainable


@dataclass
class Case:
    """A model (tiny preset + `overrides`), `skew`: the router bias that forces most rows onto
    experts 0 and 1 (EP rank 0), and the run: `steps` steps of `batch` windows (global) of
    seq_len + 1 tokens, DSA and MTP on, Muon Split, router bias updating."""

    name: str
    overrides: dict = field(default_factory=dict)
    skew: float = 0.0
    steps: int = 3
    batch: int = 4
    seq_len: int = 24

    def config(self) -> ModelConfig:
        return ModelConfig.from_preset("tiny", **{"vocab_size": 320, **self.overrides})


def build(case: Case) -> GLM5ForCausalLM:
    torch.manual_seed(0)
    model = GLM5ForCausalLM(case.config())
    if case.skew:
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf[:2] = case.skew
    return model


class EPTrainer:
    """The training set-up and step of `run` (and `benchmarks/expert_parallel.py`): `model` put in training
    mode and sharded (`shard_model(model, ctx, ep=ep)`), one stage of seq_len + 1 token windows with DSA, the
    indexer KL and MTP on, Muon Split at lr 3e-3, router bias rate 1e-2; `step` trains this rank's contiguous
    slice of a global batch (of `batch` windows, or any multiple of the process count)."""

    def __init__(self, model, ctx, ep: int, *, seq_len: int, batch: int, steps: int = 10**6):
        model.train()
        gdist.shard_model(model, ctx, ep=ep)
        self.model, self.ctx, self.n = model, ctx, 0
        self.stage = Stage("ep", steps, 3e-3, seq_len, batch // ctx.world_size, use_dsa=True, indexer_weight=1.0)
        self.hyper = TrainHyper.default(optimizer="muon-split", bias_update_rate=1e-2)
        self.optimizer = self.hyper.build_optimizer(model, self.stage.lr)
        set_trainable(model, self.stage)

    def step(self, window_BT1: torch.Tensor):
        """One optimizer step on the global batch window_BT1 [B, seq_len + 1]. Returns (this rank's
        `StepLosses`, the gradient norm before clipping, this rank's routing loads load_E summed over the
        step's MoE forwards: int64 [E])."""
        from glm5lab.train.balance import moe_layers

        b, self.n = window_BT1.shape[0] // self.ctx.world_size, self.n + 1  # any global batch (the sweep's)
        losses = stage_losses(self.model, window_BT1[self.ctx.rank * b:(self.ctx.rank + 1) * b], self.stage)
        load_E = sum(moe.load for _, moe in moe_layers(self.model))
        grad_norm, _ = optimizer_step(self.model, self.optimizer, losses, self.stage, self.n, self.hyper)
        return losses, grad_norm, load_E


def run(case: Case, ep: int = 1) -> dict:
    """Train `case` in this process (world 1) or on this rank of the initialised process group with
    expert-parallel size `ep`. Returns, on every rank: per step the losses (mean over ranks, with the step's
    gradient norm before clipping), the EP metrics, the per-rank routing loads load_RE (summed over the
    step's MoE forwards), the matrices Newton-Schulz orthogonalised over the world (`ns_blocks`) and the
    step seconds; and on rank 0 the final full state dict (`state`)."""
    ctx = gdist.setup() if dist.is_initialized() else gdist.DistContext(0, 1, torch.device("cpu"))
    trainer = EPTrainer(build(case), ctx, ep, seq_len=case.seq_len, batch=case.batch, steps=case.steps)
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 320, (case.steps, case.batch, case.seq_len + 1), generator=g)
    out = {"losses": [], "ep": [], "load_RE": [], "seconds": [], "ns_blocks": []}
    blocks = [0]
    trainer.optimizer.on_orthogonalize = lambda p, count: blocks.__setitem__(0, blocks[0] + count)
    for step in range(case.steps):
        t0 = time.perf_counter()
        losses, grad_norm, load_E = trainer.step(windows[step])
        out["seconds"].append(time.perf_counter() - t0)
        out["losses"].append({**gdist.mean_over_ranks(losses.to_log(), ctx), "grad_norm": grad_norm})
        out["ep"].append(pop_ep_metrics(trainer.model))
        out["load_RE"].append(gather_rows(load_E, ctx))
        out["ns_blocks"].append(_world_sum(blocks.pop(), ctx))
        blocks.append(0)
    full = gdist.full_model(trainer.model, ctx)
    if ctx.is_main:
        out["state"] = {k: v.detach().clone() for k, v in full.state_dict().items()}
    return out


def _world_sum(n: int, ctx) -> int:
    t = torch.tensor([n])
    if ctx.world_size > 1:
        dist.all_reduce(t)
    return int(t)


def gather_rows(load_E: torch.Tensor, ctx) -> list[list[int]]:
    if ctx.world_size == 1:
        return [load_E.tolist()]
    parts = [torch.zeros_like(load_E) for _ in range(ctx.world_size)]
    dist.all_gather(parts, load_E)
    return [p.tolist() for p in parts]


def worker(rank: int, world: int, port: int, ep: int, cases: list[Case], out_dir: str) -> None:
    """One rank of a spawned gloo group: run every case at `ep`; rank 0 saves the results."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with gdist.session():  # the groups left together, by every rank (`glm5lab.parallel.dist.teardown`)
        for case in cases:
            result = run(case, ep)
            if rank == 0:
                torch.save(result, os.path.join(out_dir, f"{case.name}-w{world}-ep{ep}.pt"))
    gdist.end_process()  # leave as every multi-process run does


def spawn(world: int, ep: int, cases: list[Case], out_dir: str) -> dict[str, dict]:
    """Run `cases` on `world` spawned processes with expert-parallel size `ep`; {case name: rank 0's result}."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(world, port, ep, cases, out_dir), nprocs=world, start_method="spawn")
    return {c.name: torch.load(os.path.join(out_dir, f"{c.name}-w{world}-ep{ep}.pt")) for c in cases}
