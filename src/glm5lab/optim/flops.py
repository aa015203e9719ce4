"""What one optimizer step costs in FLOPs: the Newton-Schulz matmuls of Muon, per the parameter-group table.

Legend: (A, B) one orthogonalised block, m = min(A, B), n = max(A, B), s Newton-Schulz steps. `newton_schulz`
works on the m x n orientation; each step is X X^T (2 m^2 n), b A + c A A (2 m^3) and a X + B X (2 m^2 n), so a
block costs s (4 m^2 n + 2 m^3) FLOPs; where Muon takes the Gram form (`newton_schulz.uses_gram`: never by
default), R0 = X X^T and the last Q X0 (2 m^2 n each), b R + c R R each step (2 m^3), Q <- H Q and R <- H R H
on all steps but one (2 m^3 + 4 m^3): 4 m^2 n + (8 s - 6) m^3 (2 per multiply-add, as `torch.utils.flop_counter`
counts mm / addmm / baddbmm; the normalisation, momentum and the elementwise AdamW update, about 10 FLOPs per
parameter, are not counted). Blocks per parameter (`glm5lab.optim.muon.blocks`): one per 2-D "muon" matrix, one
per expert of a 3-D [E, M, N] parameter, one per head for "muon_split" and one per head section with `sections`
("muon-split-kv"). AdamW parameters cost 0 here. `tests/optim/test_flops.py` ties the count to
`FlopCounterMode` around a real `MuonAdamW.step`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from glm5lab.optim.groups import param_group_table
from glm5lab.optim.muon import blocks
from glm5lab.optim.newton_schulz import uses_gram
from glm5lab.validate import int_at_least

NS_STEPS = 5
"""MuonAdamW's default Newton-Schulz steps."""


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """FLOPs of `orthogonalize_ns` (what Muon runs) on one [rows, cols] matrix, m = min, n = max: the plain form's
    steps * (4 m^2 n + 2 m^3), or the Gram form's 4 m^2 n + (8 steps - 6) m^3 where `uses_gram` (module
    docstring). Raises ValueError for rows or cols < 1 or steps < 0."""
    int_at_least("rows", rows, 1)
    int_at_least("cols", cols, 1)
    int_at_least("steps", steps, 0)
    m, n = min(rows, cols), max(rows, cols)
    if uses_gram(rows, cols, steps):
        return 4 * m * m * n + (8 * steps - 6) * m**3
    return steps * (4 * m * m * n + 2 * m**3)


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
