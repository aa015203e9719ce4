"""Optimizers: Newton-Schulz / exact orthogonalisation, Muon Split, `MuonAdamW` and the
parameter-group table. Notes: docs/optim.md."""

from glm5lab.optim.groups import (
    OPTIMIZERS, RULES, ParamRule, build_optimizer, indexer_parameter_names, param_group_table,
)
from glm5lab.optim.muon import KINDS, MuonAdamW, adjust_lr
from glm5lab.optim.newton_schulz import NS_COEFFICIENTS, muon_split, newton_schulz, orthogonalize_exact

__all__ = [
    "KINDS", "NS_COEFFICIENTS", "OPTIMIZERS", "RULES", "MuonAdamW", "ParamRule", "adjust_lr",
    "build_optimizer", "indexer_parameter_names", "muon_split", "newton_schulz", "orthogonalize_exact",
    "param_group_table",
]
