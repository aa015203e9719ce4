"""The parameter-group table: which optimizer kind, head split and weight decay every parameter gets.

`RULES` is the one declarative list: a regex (full match on the `named_parameters()` name) ->
kind under Muon, weight decay on/off, for Muon Split the config field holding the head count, and
whether the parameter belongs to the DSA indexer (what the indexer warm-up stage trains:
`indexer_parameter_names`). Every parameter must match exactly one rule (`param_group_table` raises otherwise,
listing the names), so a new module cannot silently fall into a default group. Buffers such as the router's
`e_score_correction_bias` are not parameters and never reach the optimizer.

Choices (docs/optim.md): AdamW for embedding, output head, norms and biases; Muon for every other
matrix, including the router, the indexer and the 3-D routed experts (one matrix per expert);
with "muon-split" MLA's `q_b_proj` / `kv_b_proj` (rows head-major) split per attention head, as
the GLM-5 report does; "muon-split-kv" also cuts each head's `kv_b_proj` block into its K rows
(qk_nope_head_dim) and V rows (v_head_dim), orthogonalised apart (whether the report did is not
stated; `glm5lab ablate optimizer` compares both). Weight decay: off for norms and biases, on for
the embedding and head. A split optimizer on a model with nothing to split (no MLA: a GQA model) trains as
"muon"; `split_notice` is the line `glm5lab train` (and its --dry-run) says then.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from glm5lab.optim.muon import MuonAdamW
from glm5lab.validate import one_of

OPTIMIZERS = ("adamw", "muon", "muon-split", "muon-split-kv")
SPLITS = ("muon-split", "muon-split-kv")
"""The optimizers that split MLA's up-projections per head."""

_LAYER = r"model\.(?:layers|mtp_layers)\.\d+\."
_INDEXER = rf"{_LAYER}self_attn\.indexer\."  # the lightning indexer of a main or MTP layer
_NORMS = "input_layernorm|post_attention_layernorm|self_attn\\.(?:q_a_layernorm|kv_a_layernorm|q_norm|k_norm)" \
         "|enorm|hnorm|shared_head\\.norm"


@dataclass(frozen=True)
class Rule:
    """pattern (full match) -> kind with optimizer "muon" ("muon" or "adamw"); decay: weight decay on;
    split_heads: config field with the head count when "muon-split" splits this matrix by rows;
    split_sections: config fields whose values cut each head's rows further under "muon-split-kv";
    indexer: the parameter is the DSA indexer's (trained alone by a stage with trainable="indexer")."""

    pattern: str
    kind: str
    decay: bool
    split_heads: str | None = None
    split_sections: tuple[str, ...] | None = None
    indexer: bool = False


RULES: tuple[Rule, ...] = (
    Rule(r"model\.embed_tokens\.weight", "adamw", decay=True),
    Rule(r"lm_head\.weight", "adamw", decay=True),
    Rule(rf"model\.norm\.weight|{_LAYER}(?:{_NORMS})\.weight", "adamw", decay=False),
    Rule(rf"(?!{_INDEXER}).+\.bias", "adamw", decay=False),
    # MLA up-projections, rows head-major: q_b H x (N + R), kv_b H x (N + V_h); split per head, kv_b per K / V too.
    Rule(rf"{_LAYER}self_attn\.q_b_proj\.weight", "muon", decay=True, split_heads="num_attention_heads"),
    Rule(rf"{_LAYER}self_attn\.kv_b_proj\.weight", "muon", decay=True, split_heads="num_attention_heads",
         split_sections=("qk_nope_head_dim", "v_head_dim")),
    Rule(rf"{_LAYER}self_attn\.(?:q_a_proj|kv_a_proj_with_mqa|q_proj|k_proj|v_proj|o_proj)\.weight", "muon",
         decay=True),
    # the DSA indexer: every parameter under self_attn.indexer, and only those, has indexer=True
    Rule(rf"{_INDEXER}(?:wq_b|wk|weights_proj)\.weight", "muon", decay=True, indexer=True),
    Rule(rf"{_INDEXER}k_norm\.(?:weight|bias)", "adamw", decay=False, indexer=True),
    Rule(rf"{_LAYER}mlp\.(?:|shared_experts\.)(?:gate_proj|up_proj|down_proj)\.weight", "muon", decay=True),
    Rule(rf"{_LAYER}mlp\.gate\.weight", "muon", decay=True),
    Rule(rf"{_LAYER}mlp\.experts\.(?:gate_proj|up_proj|down_proj)", "muon", decay=True),
    Rule(rf"{_LAYER}eh_proj\.weight", "muon", decay=True),
    # Gated DeltaNet / SimpleGDN mixers: z gate matrix by Muon; per-head gates, decay and conv by AdamW
    Rule(rf"{_LAYER}self_attn\.z_proj\.weight", "muon", decay=True),
    Rule(rf"{_LAYER}self_attn\.(?:a_proj|b_proj)\.weight", "adamw", decay=True),
    Rule(rf"{_LAYER}self_attn\.conv1d\.weight", "adamw", decay=True),
    Rule(rf"{_LAYER}self_attn\.(?:A_log|dt_bias|b_bias|norm\.weight)", "adamw", decay=False),
)


@dataclass(frozen=True)
class ParamRule:
    """One row of the resolved table: parameter name, kind ("muon" | "muon_split" | "adamw"),
    heads (for "muon_split", else None), decay (weight decay applies), sections (row counts
    cutting each head's block, "muon-split-kv" on kv_b_proj; else None)."""

    name: str
    kind: str
    heads: int | None = None
    decay: bool = True
    sections: tuple[int, ...] | None = None


def _match_one(names: list[str], rules=RULES) -> dict[str, Rule]:
    """name -> its only matching rule; raises ValueError listing uncovered and doubly-covered names."""
    hits = {n: [r for r in rules if re.fullmatch(r.pattern, n)] for n in names}
    uncovered = [n for n, rs in hits.items() if not rs]
    doubled = [n for n, rs in hits.items() if len(rs) > 1]
    if uncovered or doubled:
        raise ValueError(f"optimizer group table must cover every parameter exactly once; "
                         f"uncovered: {uncovered}; covered more than once: {doubled}")
    return {n: rs[0] for n, rs in hits.items()}


def _resolve(name: str, rule: Rule, optimizer: str, config) -> ParamRule:
    if optimizer == "adamw" or rule.kind == "adamw":
        return ParamRule(name, "adamw", None, rule.decay)
    if optimizer in SPLITS and rule.split_heads is not None:
        sections = None
        if optimizer == "muon-split-kv" and rule.split_sections is not None:
            sections = tuple(getattr(config, f) for f in rule.split_sections)
            if min(sections) < 1:
                given = ", ".join(f"{f} = {v}" for f, v in zip(rule.split_sections, sections, strict=True))
                raise ValueError(f"optimizer 'muon-split-kv' cuts {name} per head into sections of {given} rows: "
                                 "each must be >= 1 (use 'muon-split' for this model)")
        return ParamRule(name, "muon_split", getattr(config, rule.split_heads), rule.decay, sections)
    return ParamRule(name, "muon", None, rule.decay)


def param_group_table(model: nn.Module, optimizer: str) -> list[ParamRule]:
    """One ParamRule per `model.named_parameters()` entry (a tied weight appears once), in order.

    model: a `GLM5ForCausalLM` (needs `model.config` for head counts). optimizer: one of
    OPTIMIZERS. Raises ValueError for an unknown optimizer, or when a parameter matches no rule
    or several (the message lists those names)."""
    one_of("optimizer", optimizer, OPTIMIZERS)
    names = [n for n, _ in model.named_parameters()]
    matched = _match_one(names)
    return [_resolve(n, matched[n], optimizer, model.config) for n in names]


def split_notice(model: nn.Module, optimizer: str) -> str | None:
    """The one line to say when `optimizer` is "muon-split" or "muon-split-kv" and `model` holds no matrix it splits
    (no MLA up-projection q_b_proj / kv_b_proj: a GQA model): it then trains exactly as "muon", which a run should
    not do without a word. None otherwise. Runs `param_group_table`, so it raises its ValueErrors (an unknown
    optimizer, K/V sections of zero rows); `model` may live on the meta device (no weights are needed)."""
    rows = param_group_table(model, optimizer)
    if optimizer not in SPLITS or any(row.kind == "muon_split" for row in rows):
        return None
    kinds = sorted(set(model.config.attention_types))
    return (f"optimizer {optimizer!r} splits MLA's up-projections (q_b_proj, kv_b_proj) per head, and this model has "
            f"none (attention_types {kinds}): it trains exactly as 'muon'")


def indexer_parameter_names(model: nn.Module) -> set[str]:
    """Names (as `model.named_parameters()` gives them) of the DSA indexer's parameters, main layers
    and MTP layer: those whose rule has indexer=True. Raises ValueError as `param_group_table`."""
    matched = _match_one([n for n, _ in model.named_parameters()])
    return {n for n, rule in matched.items() if rule.indexer}


def build_optimizer(model: nn.Module, optimizer: str, *, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), momentum: float = 0.95,
                    eps: float = 1e-8) -> MuonAdamW:
    """MuonAdamW over every parameter of `model`, grouped by (kind, heads, sections, decay) per the table.

    One lr for all groups (adjust_lr_fn "match_rms_adamw" scales Muon blocks to AdamW's RMS);
    weight_decay applies to rows with decay=True, 0 elsewhere. Frozen parameters are included
    (they have no grad, so the step skips them) so unfreezing later needs no new optimizer.
    Groups carry `param_names`. Raises ValueError as `param_group_table`."""
    params = dict(model.named_parameters())
    groups: dict[tuple, dict] = {}
    for row in param_group_table(model, optimizer):
        key = (row.kind, row.heads, row.sections, row.decay)
        if key not in groups:
            groups[key] = {"params": [], "kind": row.kind, "heads": row.heads,
                           "weight_decay": weight_decay if row.decay else 0.0}
            if row.sections is not None:
                groups[key]["sections"] = row.sections
        groups[key]["params"].append((row.name, params[row.name]))
    return MuonAdamW(list(groups.values()), lr=lr, betas=betas, momentum=momentum, eps=eps)
