"""Sharded checkpoints (issue 27): per-rank memory of a 2-process save, sharded (DCP) beside the old full gather.

    python benchmarks/sharded_checkpoint.py [--preset small] [--procs 2] [--ep 1] [--out DIR]

The script launches itself under `python -m torch.distributed.run --standalone --nproc_per_node=PROCS`
(`--worker`; gloo on CPU, 1 torch thread per process). Every rank builds the preset's model (seed 0),
shards it as `glm5lab train` does (`glm5lab.parallel.dist.shard_model`, FSDP2, `--ep` experts by expert),
builds Muon Split and trains one step (batch 1 x 64 tokens a rank, the dense stage's losses) so the
optimizer holds its state. Then, on every rank, twice:
- `sharded`: `glm5lab.checkpoints.dcp.save` (what a run now writes: each rank its own shards,
  nothing gathered);
- `full gather`: what a distributed run wrote before issue 27 (`dist.full_model` +
  `get_optimizer_state_dict` with full_state_dict, gathered to CPU on every rank, then rank 0 writes the
  HF folder (`save_pretrained`) + trainer_state.pt (`torch.save`)).
Per rank and save: RSS before (VmRSS of /proc/self/status, after `gc.collect` and glibc's `malloc_trim(0)`,
which returns freed heap pages, so that a save cannot hide its allocations in memory freed earlier), the peak during it
(VmHWM, reset just before the save by writing 5 to /proc/self/clear_refs) and its rise = peak - before;
"own shard" = the bytes of this rank's local shards of the parameters and the optimizer state (the size
of its `__R_0.distcp` file is printed beside it). The goal: no rank's rise exceeds its own shard.
Prints a table, then one JSON line (last).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 2**20


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


def _measure(save) -> dict:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system: the rise counts new pages only
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    save()
    peak = _status("VmHWM")
    return {"rss_before": before, "peak": peak, "rise": peak - before}


def _local_bytes(model, optimizer) -> int:
    """Bytes of this rank's local shards of the parameters and the optimizer state."""
    import torch

    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    tensors = [local(p) for p in model.parameters()]
    tensors += [local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(args) -> None:
    import torch
    import torch.distributed as tdist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from glm5lab import GLM5ForCausalLM, ModelConfig
    from glm5lab.checkpoints.dcp import rng_state, save
    from glm5lab.parallel import dist
    from glm5lab.train.losses import stage_losses
    from glm5lab.train.recipe import TrainHyper, default_stages
    from glm5lab.train.step import optimizer_step

    torch.set_num_threads(1)
    ctx = dist.setup()
    cfg = ModelConfig.from_preset(args.preset)
    torch.manual_seed(0)
    model = GLM5ForCausalLM(cfg)
    dist.shard_model(model, ctx, ep=args.ep)
    hyper = TrainHyper.default()
    stage = default_stages(seq_len=64, batch_size=1)[0]
    optimizer = hyper.build_optimizer(model, stage.lr)
    window = torch.randint(0, cfg.vocab_size, (1, 65), generator=torch.Generator().manual_seed(ctx.rank))
    optimizer_step(model, optimizer, stage_losses(model, window, stage), stage, 1, hyper)
    own = _local_bytes(model, optimizer)
    run = Path(args.out)
    position = {"step": 1, "stage": 0, "in_stage": 1}

    def sharded():
        save(run / "sharded" / "step-000001", model, optimizer, {"position": position, "ep": args.ep})

    def full_gather():
        full_state = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=full_state), "rng": rng_state(),
                 "position": position}
        full = dist.full_model(model, ctx)
        if ctx.is_main:
            full.save_pretrained(run / "full")
            torch.save(state, run / "full" / "trainer_state.pt")
        dist.barrier(ctx)

    row = {"rank": ctx.rank, "own_shard": own}
    row["sharded"] = _measure(sharded)
    row["shard_file"] = (run / "sharded" / "step-000001" / f"__{ctx.rank}_0.distcp").stat().st_size
    row["full_gather"] = _measure(full_gather)
    rows = [None] * ctx.world_size
    tdist.all_gather_object(rows, row)
    if ctx.is_main:
        Path(args.result).write_text(json.dumps(rows))
    dist.teardown(ctx)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--out", help="where the checkpoints go (default: a temporary folder, removed)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        result = Path(tmp) / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.procs}",
                        __file__, "--worker", "--preset", args.preset, "--ep", str(args.ep), "--out", out,
                        "--result", str(result)], env=env, check=True)
        rows = json.loads(result.read_text())
    print(f"preset {args.preset}, {args.procs} processes, --ep {args.ep}, gloo on CPU, 1 torch thread each; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'rank':>4} {'save':<12} {'RSS before':>11} {'peak':>9} {'rise':>9} {'own shard':>10} {'shard file':>11} "
          f"{'rise/shard':>10}")
    for r in rows:
        for kind in ("sharded", "full_gather"):
            m = r[kind]
            print(f"{r['rank']:>4} {kind:<12} {m['rss_before'] / MiB:>8.1f} MiB {m['peak'] / MiB:>6.1f} MiB "
                  f"{m['rise'] / MiB:>6.1f} MiB {r['own_shard'] / MiB:>6.1f} MiB {r['shard_file'] / MiB:>7.1f} MiB "
                  f"{m['rise'] / r['own_shard']:>10.2f}")
    ok = all(r["sharded"]["rise"] <= r["own_shard"] for r in rows)
    print(json.dumps({"benchmark": "sharded_checkpoint", "preset": args.preset, "procs": args.procs, "ep": args.ep,
                      "threads_per_process": 1, "load_average_1min": os.getloadavg()[0],
                      "sharded_rise_within_own_shard": ok, "ranks": rows}))


if __name__ == "__main__":
    main()
