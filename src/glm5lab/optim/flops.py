"""What one optimizer step costs in FLOPs: the Newton-Schulz matmuls of Muon, per the parameter-group table.

Legend: (A, B) one orthogonalised block, m = min(A, B), n = max(A, B), s Newton-Schulz steps. `newton_schulz`
works on the m x n orientation; each step is X X^T (2 m^2 n), b A + c A A (2 m^3) and a X + B X (2 m^2 n), so a
block costs s (4 m^2 n + 2 m^3) FLOPs (2 per multiply-add, as `torch.utils.flop_counter` counts mm / addmm /
baddbmm; the normalisation, momentum and the elementwise AdamW update, about 10 FLOPs per parameter, are not
counted). Blocks per parameter (`glm5lab.optim.muon.block_shape`): one per 2-D "muon" matrix, one per expert
of a 3-D [E, M, N] parameter, one per head for "muon_split" and one per head section with `sections`
("muon-split-kv"). AdamW parameters cost 0 here. `tests/optim/test_flops.py` ties the count to
`FlopCounterMode` around a real `MuonAdamW.step`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from glm5lab.optim.groups import param_group_table
from glm5lab.optim.muon import KINDS
from glm5lab.optim.newton_schulz import check_sections
from glm5lab.validate import int_at_least, is_int, one_of

NS_STEPS = 5
"""MuonAdamW's default Newton-Schulz steps."""


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """FLOPs of `newton_schulz` on one [rows, cols] matrix: steps * (4 m^2 n + 2 m^3), m = min, n = max
    (module docstring). Raises ValueError for rows or cols < 1 or steps < 0."""
    int_at_least("rows", rows, 1)
    int_at_least("cols", cols, 1)
    int_at_least("steps", steps, 0)
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def blocks(shape: tuple[int, ...], kind: str, heads: int | None = None,
           sections: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """The [A, B] blocks Muon orthogonalises for one parameter of `shape` in a group of `kind` ("adamw": none;
    "muon": the matrix, or each of E experts of [E, M, N]; "muon_split": each head's [M/H, N], or each section
    of it). Raises ValueError, naming it, for an unknown kind, a shape the kind cannot take, heads that do not
    divide the rows, or sections on another kind or not summing to a head's rows (`MuonAdamW`'s own checks)."""
    one_of("kind", kind, KINDS)
    if sections is not None and kind != "muon_split":
        raise ValueError(f"sections={sections!r} are only allowed with kind 'muon_split', not {kind!r}")
    if kind == "adamw":
        return []
    if kind == "muon_split":
        if len(shape) != 2 or not is_int(heads) or heads < 1 or shape[0] % heads:
            raise ValueError(f"kind 'muon_split' needs a 2-D shape whose rows divide by heads; got {tuple(shape)} "
                             f"with heads={heads!r}")
        rows, cols = shape[0] // heads, shape[1]
        if sections is None:
            return [(rows, cols)] * heads
        return [(s, cols) for s in check_sections(sections, rows)] * heads
    if len(shape) not in (2, 3):
        raise ValueError(f"kind 'muon' needs a 2-D [M, N] or 3-D [E, M, N] shape, got {tuple(shape)}")
    *experts, rows, cols = shape
    return [(rows, cols)] * (experts[0] if experts else 1)


def optimizer_flops(model: nn.Module, optimizer: str, *, steps: int = NS_STEPS,
                    trains: Callable[[str], bool] | None = None) -> dict:
    """Newton-Schulz FLOPs of one step of `build_optimizer(model, optimizer)` (module docstring).

    model: a `GLM5ForCausalLM` (the meta device is enough: only shapes are read). trains(name): whether the
    parameter has a gradient this step (default: every parameter; the indexer warm-up trains only
    `indexer_parameter_names`). Returns {"newton_schulz": FLOPs, "blocks": orthogonalised blocks,
    "muon_params": elements updated by Muon, "adamw_params": by AdamW}, counted over the parameters that train.
    Raises ValueError as `param_group_table`."""
    params = dict(model.named_parameters())
    out = {"newton_schulz": 0, "blocks": 0, "muon_params": 0, "adamw_params": 0}
    for row in param_group_table(model, optimizer):
        if trains is not None and not trains(row.name):
            continue
        shape = tuple(params[row.name].shape)
        bl = blocks(shape, row.kind, row.heads, row.sections)
        out["newton_schulz"] += sum(newton_schulz_flops(a, b, steps) for a, b in bl)
        out["blocks"] += len(bl)
        out["muon_params" if bl else "adamw_params"] += params[row.name].numel()
    return out
