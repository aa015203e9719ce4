"""The part of a parameter this process holds: a DTensor's local shard (FSDP2, expert parallelism), else the
tensor itself. Under `torch.no_grad` it is the storage the DTensor holds, so in-place ops (an init's draws) write
this rank's shard and nothing else."""

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
