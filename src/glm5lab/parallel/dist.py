"""Data-parallel training with FSDP2, applied from outside the model.

Under `torchrun --nproc_per_node=N`, `setup()` joins the process group (NCCL on GPUs, gloo on
CPUs) and `shard_model` applies `fully_shard` to every decoder block, the MTP layer and the root.
Each rank reads its slice of every global batch (`BatchStream(rank=, world_size=)`), so N ranks
with batch B see what one process with batch N*B sees. A single process skips all of it. With
`--ep N` (`shard_model(..., ep=N)`) the routed experts are also split by expert over groups of N
ranks and tokens reach them by all-to-all (`glm5lab.parallel.expert_parallel`); with `--cp N` each sequence is split
over groups of N ranks that read the same rows (`context_parallel`: `glm5lab.parallel.context_parallel`). One place
builds the ("dp", "cp", "ep") mesh: `device_mesh`. Under torchrun the model is built on
the meta device (`build_meta`), sharded, then allocated and each rank draws its own shards (`materialize`): no rank
holds or draws the whole model.
Source: torch.distributed.fsdp.fully_shard (FSDP2) documentation; torchtitan's parallelize step.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from glm5lab.parallel.launcher import exit_with_launcher

_joined = False
"""Whether `setup` joined a process group in this process (`joined`)."""


@dataclass
class DistContext:
    """This process's place in the run; `mesh`: the ("dp", "cp", "ep") DeviceMesh `shard_model` built (`device_mesh`;
    None in one process or before sharding)."""

    rank: int
    world_size: int
    device: torch.device
    mesh: object | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self):
        """bf16 autocast on CUDA (fp32 master weights); plain fp32 on CPU (no bf16 units there)."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


def world_size() -> int:
    """The number of processes torchrun started (WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup() -> DistContext:
    """This process's place in the run: one process, or (WORLD_SIZE > 1) a rank of the process group it joins
    (NCCL on CUDA, gloo otherwise; `glm5lab.parallel.launcher.exit_with_launcher` first: `glm5lab.cli.main` armed it
    already, before the command's checks, in a rank of `glm5lab`). Leave it with `teardown` (or `session`)."""
    cuda = torch.cuda.is_available()
    if world_size() == 1:
        return DistContext(0, 1, torch.device("cuda" if cuda else "cpu"))
    global _joined
    exit_with_launcher()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    _joined = True
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return DistContext(dist.get_rank(), dist.get_world_size(), device)


def device_mesh(ctx: DistContext, *, cp: int = 1, ep: int = 1):
    """The run's 3-D DeviceMesh ("dp", "cp", "ep") of world / (cp ep) x cp x ep ranks, expert innermost, then
    context (rank r: EP index r % ep, CP index (r // ep) % cp); None in one process (after the same check). The one
    place the mesh is built: `shard_model` calls it and keeps it as `ctx.mesh`. Raises ValueError (`check_mesh`)."""
    from glm5lab.parallel.context_parallel import check_mesh

    dp = check_mesh(ctx.world_size, cp, ep)
    if ctx.world_size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, (dp, cp, ep), mesh_dim_names=("dp", "cp", "ep"))


def shard_model(model, ctx: DistContext, *, param_dtype: torch.dtype | None = None, ep: int = 1, cp: int = 1):
    """Move to the device; with several ranks, build the mesh (`device_mesh(ctx, cp=cp, ep=ep)`, kept as
    `ctx.mesh`: `context_parallel` reads its "cp" group) and shard parameters with FSDP2 (and, with ep > 1, the
    routed experts by expert: expert parallelism). Returns the module to call (the same object: fully_shard works
    in place).

    Everything but the routed experts is FSDP2-sharded over the whole world, with or without --ep and --cp (the
    ranks of a CP group compute different tokens of the same rows, so their gradients are averaged like any data-
    parallel rank's). With ep > 1 each MoE's routed experts are split by expert over the "ep" dimension and
    FSDP2-sharded over the flattened ("dp", "cp") dimensions (the other ranks holding the same experts), and their
    gradients are divided by the whole world size, as every other gradient (`glm5lab.parallel.expert_parallel`).
    Raises ValueError for a cp x ep that does not divide the world size (`check_mesh`) or an ep that does not divide
    the routed experts (`check_ep`).

    param_dtype: FSDP2 mixed precision (e.g. torch.bfloat16): parameters are all-gathered and
    computed in this dtype, gradients reduced in fp32, master weights stay fp32. The `KeepFP32`
    modules of each block (router, indexer weights_proj and k_norm; `glm5lab.model.precision`)
    form their own FSDP group with an fp32 policy, so their values reach the forward unrounded.
    None (default) = no FSDP casting (the training loop uses bf16 autocast on CUDA instead).
    Only with several ranks: a single process is not sharded, and its model keeps its dtype."""
    from glm5lab.parallel.alltoall import check_ep
    from glm5lab.parallel.expert_parallel import apply_expert_parallel

    check_ep(ep, None, model.config)
    ctx.mesh = device_mesh(ctx, cp=cp, ep=ep)
    # a meta model (`build_meta`) is allocated on the device by `materialize`
    if not any(p.is_meta for p in model.parameters()):
        model.to(ctx.device)
    if ctx.world_size == 1:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from glm5lab.model.moe import MoE
    from glm5lab.model.precision import KeepFP32

    mesh = ctx.mesh
    world = mesh._flatten("world")
    replicas = mesh["dp", "cp"]._flatten("dp_cp")  # the ranks that hold the same experts
    if ep > 1:
        apply_expert_parallel(model, mesh)
    low = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for layer in list(model.model.layers) + list(model.model.mtp_layers):
        keep = [m for m in layer.modules() if isinstance(m, KeepFP32) and any(True for _ in m.parameters())]
        if param_dtype is not None and keep:
            fully_shard(keep, mesh=world, mp_policy=fp32)
        for moe in (m for m in layer.modules() if isinstance(m, MoE) and ep > 1):
            fully_shard(moe.experts, mesh=replicas, mp_policy=low)
            moe.experts.set_gradient_divide_factor(float(ctx.world_size))  # the mean over every rank's batch
            # sum, then divide (gloo has no PREMUL_SUM); not on a 1-rank replica group (ep = world size), where torch
            # 2.13's FSDP2 would divide by the factor twice (its no-communication path divides, then its post-divide)
            moe.experts.set_force_sum_reduction_for_comms(ctx.world_size > ep)
        fully_shard(layer, mesh=world, mp_policy=low)
    fully_shard(model, mesh=world, mp_policy=low)
    return model


def context_parallel(ctx: DistContext, cp: int, layout: str):
    """The run's `ContextParallel` over the "cp" group of the mesh `shard_model` built (`ctx.mesh`), in `layout`;
    None when cp is 1 (the model then runs as without CP). Raises ValueError when cp > 1 and the mesh has no such
    "cp" dimension (shard_model not called with this cp)."""
    from glm5lab.parallel.context_parallel import ContextParallel

    if cp == 1:
        return None
    if ctx.mesh is None or ctx.mesh["cp"].size() != cp:
        raise ValueError(f"--cp {cp}: the run's mesh has no \"cp\" dimension of {cp} ranks (shard the model with "
                         f"shard_model(..., cp={cp}) first)")
    return ContextParallel(ctx.mesh.get_group("cp"), layout)


def data_slice(ctx: DistContext, cp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(the data slice this rank reads, how many slices): `context_parallel.data_rank` of world / cp slices; the
    ranks of a CP group read the same rows (`BatchStream(rank=, world_size=)` takes these two)."""
    from glm5lab.parallel.context_parallel import data_rank

    return data_rank(ctx.rank, cp, ep), ctx.world_size // cp


def build_meta(cfg):
    """`GLM5ForCausalLM(cfg)` on the meta device: shapes, no memory, no draws. Shard it (`shard_model`), then
    `materialize` it."""
    from glm5lab import GLM5ForCausalLM

    with torch.device("meta"):
        return GLM5ForCausalLM(cfg)


def materialize(model, ctx: DistContext, seed: int) -> None:
    """Allocate the (sharded) meta model on `ctx.device` (`to_empty`) and draw each rank's own shards from the
    init's distributions (`GLM5ForCausalLM.reset_parameters`) with a generator on `ctx.device` seeded by (seed,
    rank): a rank's init costs its shard, not the model. The values are reproducible for one seed, process layout
    (world size, --ep) and device type, but they are not one process's `torch.manual_seed(seed)` init (docs/scaling.md:
    runs compared across process counts start from one checkpoint). Call after `shard_model`, before loading any
    weights."""
    model.to_empty(device=ctx.device)
    generator = torch.Generator(ctx.device).manual_seed((seed * 2**20 + ctx.rank) % 2**63)
    model.reset_parameters(generator)


def local_part(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full value `full` of the (possibly DTensor) `target`: its local shard,
    cut locally by `target`'s placements (no communication); `full` itself for a plain tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(target, DTensor):
        return full
    mesh = target.device_mesh
    return distribute_tensor(full.to(mesh.device_type), mesh, target.placements, src_data_rank=None).to_local()


def full_model(model, ctx: DistContext):
    """A module whose state_dict holds full tensors, on rank 0 (None on the others); the model itself when
    unsharded. Gathers the whole model: training saves sharded checkpoints instead
    (`glm5lab.checkpoints.dcp`); tests and benchmarks compare against it."""
    if ctx.world_size == 1:
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from glm5lab import GLM5ForCausalLM

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not ctx.is_main:
        return None
    with torch.device("meta"):
        full = GLM5ForCausalLM(model.config)
    full.load_state_dict(state, assign=True)
    return full


def mean_over_ranks(values: dict, ctx: DistContext) -> dict:
    """Average the float entries of `values` (None and lists of floats allowed) over ranks, so
    what rank 0 logs is the global batch's loss, as in a single process."""
    if ctx.world_size == 1:
        return values
    keys = [k for k, v in values.items() if v is not None]
    flat = [x for k in keys for x in (values[k] if isinstance(values[k], list) else [values[k]])]
    t = torch.tensor(flat, dtype=torch.float64)
    dist.all_reduce(t)
    t /= ctx.world_size
    out, i = dict(values), 0
    for k in keys:
        n = len(values[k]) if isinstance(values[k], list) else 1
        out[k] = t[i:i + n].tolist() if isinstance(values[k], list) else float(t[i])
        i += n
    return out


def barrier(ctx: DistContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def teardown(ctx: DistContext | None = None, *, barrier: bool = True) -> None:
    """Leave the process group the same way on every rank. With `barrier`: wait until every rank is done with every
    collective (none then closes its connections while a peer still uses them), then destroy every group (the device
    meshes' too) and collect the garbage that still refers to them. Without `barrier` (after an error or Ctrl-C,
    when a peer may be gone or inside a collective): destroy at once. A no-op without a process group (one process,
    or after `teardown`). The runs (`session`) and the tests' multi-process drivers all leave their groups here.

    Destroying a group does not end its gloo threads while anything refers to the group object, and in torch 2.13
    something always does once DTensor is used (`torch.distributed.nn.functional`'s default arguments hold the world
    group; DTensor's sharding caches hold the device meshes, which hold their groups): those threads then end with the
    interpreter, in no fixed order, which is where a rank rarely aborted ("terminate called without an active
    exception", exit -6; pytorch/pytorch#65231 is that abort, from a group the interpreter never destroyed). A process
    that ends with its run leaves through `end_process`, which skips that."""
    if not dist.is_initialized() or (ctx is not None and ctx.world_size == 1):
        return
    if barrier:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()


def joined() -> bool:
    """Whether this process joined a process group (`setup` under torchrun), torn down or not."""
    return _joined


def end_process(status: int = 0) -> NoReturn:
    """End this process now with `status`, after its process group's `teardown`: run the atexit handlers and flush
    stdout and stderr, then `os._exit`, skipping the interpreter's finalization and C++'s static destructors, where
    the destroyed groups' gloo threads (still referenced: `teardown`) would otherwise be torn down in no fixed order.
    For processes that end with their run: torchrun's ranks of `glm5lab` (`glm5lab.cli.main`) and the tests'
    multi-process drivers."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


@contextlib.contextmanager
def session(ctx: DistContext | None = None):
    """`teardown(ctx)` when the `with` block ends (ctx None: whatever group `torch.distributed` holds): with a
    barrier when the block ends normally; without one when it raises (a peer may be gone or inside a collective), and
    then only where destroying cannot block: always with gloo, after Ctrl-C also with NCCL (torchrun sends the
    interrupt to every rank; after another error NCCL's abort could wait on ranks still inside a collective, so the
    process exits as it is and its launcher stops the others)."""
    try:
        yield ctx
    except KeyboardInterrupt:
        teardown(ctx, barrier=False)
        raise
    except BaseException:
        if dist.is_initialized() and dist.get_backend() == "gloo":
            teardown(ctx, barrier=False)
        raise
    teardown(ctx)
