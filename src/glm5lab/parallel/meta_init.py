"""Build a model on the meta device and initialise only this rank's shards, to the exact values of
one process's seeded init.

One process builds `torch.manual_seed(seed); GLM5ForCausalLM(cfg)` on the CPU: every `nn.Linear` draws its
kaiming init, `reset_parameters` then draws `normal_` per module in module order, GDN layers compute
`A_log` from a uniform draw, norms are ones. The values depend on the global generator's position at each
draw. `record_build(build, seed)` runs the same constructor with the meta device as default under a
`TorchDispatchMode` that records every op producing a meta tensor (its aten function, its arguments, and for
a random op the CPU generator state before it) and keeps the generator where the real build leaves it: each
random op is also run once on a CPU scratch tensor of the same shape (then freed), so the generator is
consumed exactly as by the real build. The recording is a small program per storage: the op that created it,
then the in-place ops that wrote it, each reading other storages at their version of that moment.

`InitRecord.materialize(model, local_of)` replays, one parameter (or buffer) at a time, the ops that made
its final value on the CPU, with the generator set to each recorded state, and copies this rank's part of
the full value into the already sharded, `to_empty`-allocated tensor (`local_of(param, full) -> local
slice`). One parameter's full value is alive at a time (plus the temporaries its own ops need); the full
model is never. Afterwards the generator is back where the real build leaves it.

Exactness: the CPU generator is a pure function of its state (`torch.get_rng_state`/`set_rng_state`), and
each replayed op is the recorded aten op on CPU tensors of the recorded shapes and dtypes, so each value is
the one the CPU build computes, bit for bit (`tests/train/test_meta_init.py` compares every tensor).
Refused (RuntimeError naming the op): an op reading or writing part of a storage (a view that is not the
whole tensor), which a per-storage replay cannot reproduce.
Source: torch.utils._python_dispatch.TorchDispatchMode; FSDP2's meta-device init (`fully_shard` on meta,
`to_empty`, then init), as in torchtitan's `init_weights` step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map


@dataclass
class _Op:
    func: object
    args: tuple
    kwargs: dict
    rng: torch.Tensor | None
    """CPU generator state before the op (random ops only)."""


@dataclass
class _Storage:
    shape: tuple
    dtype: torch.dtype
    ops: list[_Op] = field(default_factory=list)
    """ops[0] created the value (or wrote all of an empty one); the rest wrote it in place, in order."""


@dataclass(frozen=True)
class _Ref:
    """A meta tensor argument: storage `key` as it was after its first `version` ops."""

    key: int
    version: int


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _whole(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.storages: dict[int, _Storage] = {}
        self.alive: list = []  # the meta storages: their keys stay unique while recorded

    def _ref(self, t: torch.Tensor, func) -> _Ref:
        key = _key(t)
        if key not in self.storages or not _whole(t):
            raise RuntimeError(f"meta init: {func} reads a meta tensor the recording cannot replay (a view of part of "
                               "a storage, or one made outside the recording)")
        return _Ref(key, len(self.storages[key].ops))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rng = torch.get_rng_state() if _random(func) else None
        if rng is not None:  # consume the generator as the CPU build does
            func(*tree_map(_scratch, args), **{**tree_map(_scratch, kwargs), **_cpu_device(kwargs)})
        mutated = [a for a in _mutated_args(func, args, kwargs) if isinstance(a, torch.Tensor) and a.is_meta]
        out = func(*args, **kwargs)
        if any(a.is_meta for a in _tensors(out)) or mutated:
            self._record(func, args, kwargs, out, mutated, rng)
        return out

    def _record(self, func, args, kwargs, out, mutated, rng):
        outs = [t for t in _tensors(out) if t.is_meta]
        fresh = [t for t in outs if _key(t) not in self.storages]
        if not mutated and not fresh:
            return  # a view or alias of a recorded storage (detach, Parameter): nothing new
        if len(mutated) + len(fresh) != 1:
            raise RuntimeError(f"meta init: {func} writes {len(mutated) + len(fresh)} meta tensors; one is replayable")
        target = (mutated or fresh)[0]
        if not _whole(target):
            raise RuntimeError(f"meta init: {func} writes part of a meta tensor; the recording replays whole tensors")
        args_r, kwargs_r = tree_map(lambda a: self._ref(a, func) if isinstance(a, torch.Tensor) and a.is_meta else a,
                                    (args, kwargs))
        op = _Op(func, args_r, kwargs_r, rng)
        key = _key(target)
        if fresh:
            self.storages[key] = _Storage(tuple(target.shape), target.dtype, [op])
            self.alive.append(target.untyped_storage())
        else:
            self.storages[key].ops.append(op)


def _tensors(out) -> list:
    return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]


def _mutated_args(func, args, kwargs) -> list:
    schema = func._schema
    found = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            found.append(args[i] if i < len(args) else kwargs.get(a.name))
    return found


def _scratch(a):
    return torch.empty(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) and a.is_meta else a


def _cpu_device(kwargs: dict) -> dict:
    return {"device": torch.device("cpu")} if "device" in kwargs else {}


@dataclass
class InitRecord:
    """What `record_build` saw: per meta storage, the ops that made its value; `rng_after` is the CPU
    generator state the real build leaves."""

    storages: dict[int, _Storage]
    rng_after: torch.Tensor
    alive: list
    named: dict[str, torch.Tensor]
    """The built model's parameters and buffers (meta tensors) by name, before any sharding."""

    def full_value(self, t: torch.Tensor) -> torch.Tensor:
        """The full CPU value the seeded CPU build gives the recorded meta tensor `t` (its storage's last
        version). Sets the CPU generator: call `restore_rng` when done. Raises KeyError for a tensor
        not made during the recording."""
        key = _key(t)
        return self._value(key, len(self.storages[key].ops))

    def _value(self, key: int, version: int) -> torch.Tensor:
        st, value = self.storages[key], None
        for op in st.ops[:version]:
            args, kwargs = tree_map(lambda a: self._value(a.key, a.version) if isinstance(a, _Ref) else a,
                                    (op.args, op.kwargs))
            if value is not None:  # an in-place op: it writes the value built so far
                args = (value, *args[1:])
            if op.rng is not None:
                torch.set_rng_state(op.rng)
            kwargs = {**kwargs, **_cpu_device(kwargs)}
            out = op.func(*args, **kwargs)
            value = out if value is None else value
        return value

    def restore_rng(self) -> None:
        torch.set_rng_state(self.rng_after)

    def materialize(self, tensors: list[tuple[torch.Tensor, torch.Tensor]], local_of) -> None:
        """For each (meta tensor as recorded, allocated sharded tensor), fill the latter with this rank's
        part of the former's full value: `local_of(sharded, full_cpu)` returns it (any device). Leaves
        the generator as the real build does."""
        try:
            with torch.no_grad():
                for recorded, target in tensors:
                    local = local_of(target, self.full_value(recorded))
                    _local_tensor(target).copy_(local)
        finally:
            self.restore_rng()


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def record_build(build, seed: int):
    """(model, InitRecord): `torch.manual_seed(seed); build()` with every tensor on the meta device,
    recorded (module docstring). The CPU generator ends where the real build leaves it."""
    torch.manual_seed(seed)
    rec = _Recorder()
    with torch.device("meta"), rec:
        model = build()
    named = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    return model, InitRecord(rec.storages, torch.get_rng_state(), rec.alive, named)
