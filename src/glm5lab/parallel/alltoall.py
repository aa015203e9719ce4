"""Bytes the expert-parallel all-to-alls move: from routing counts, and per token under uniform routing.

Expert parallelism (EP) shards the routed experts by expert over an EP group of `ep` ranks. Each MoE
layer then runs two all-to-alls: dispatch (every routed row to the rank holding its expert) and combine
(each expert output back to its token's rank); the backward pass runs the same two in reverse with the
gradients. `a2a_bytes` is the contract the dispatcher's measured bytes are tested against, exactly;
`a2a_per_token` is its closed form under uniform routing (`tests/test_deployment.py` pins one to the
other). `check_ep` is the rule an EP size obeys, in training and in the ledger. Pure arithmetic: no torch.
Derivations: `docs/ledger.md`, "Deployment accounts".

Legend: R world ranks, E routed experts (`n_routed_experts`), K experts per token
(`num_experts_per_tok`), D `hidden_size`, b bytes per element of the payload dtype.
"""

from __future__ import annotations

from glm5lab.config import ModelConfig
from glm5lab.validate import dtype_bytes, dtype_name, int_at_least, is_int, refuse


def expert_rank(e: int, n_experts: int, ep: int) -> int:
    """The EP index holding routed expert `e`: contiguous blocks of E / ep experts, e // (E / ep)."""
    return e // (n_experts // ep)


def crossing_rows(load_RE, ep: int) -> int:
    """Rows of `load_RE` whose expert lives on another EP index than their source rank (r % ep).

    Validates as `a2a_bytes` (the errors it lists for load_RE and ep)."""
    E = _check_load(load_RE, ep)
    return sum(n for r, row in enumerate(load_RE) for e, n in enumerate(row)
               if expert_rank(e, E, ep) != r % ep)


def a2a_bytes(load_RE, ep: int, hidden_size: int, dtype: str, *, backward: bool = True) -> int:
    """Token-payload bytes the EP dispatch and combine all-to-alls move, summed over all ranks.

    load_RE: R lists (one per world rank r = 0..R-1, in rank order) of E Python ints: load_RE[r][e] =
      the rows (token x expert assignments: a token routed to K experts is K rows) that rank r's tokens
      route to routed expert e, for one MoE forward or summed over several (layers, micro-batches).
    World layout: a 2-D mesh (data, expert) with expert innermost, so rank r has EP index r % ep (and
      data index r // ep); routed expert e lives on EP index e // (E / ep) of the same data replica
      (contiguous blocks of E / ep experts).
    A row crosses ranks when its expert's EP index differs from its source rank's EP index; rows whose
      expert is on their own rank are a local copy and count 0. Each crossing row is counted once per
      collective, also when the same token sends several rows to one remote rank (no per-rank
      deduplication of tokens, which DeepEP-style dispatch does).
    Returns crossing rows x hidden_size x b x 2 (dispatch sends the row, combine returns its expert
      output, the same [hidden_size] size) x (2 when `backward`: the backward all-to-alls move the
      gradients, the same sizes in reverse; 1 for a forward only), b = bytes per element of `dtype`
      (`glm5lab.validate.DTYPES`: fp32 4, bf16 / fp16 2, fp8 1). Bytes sent by all ranks = bytes
      received by all ranks; one count, not both.
    Not counted: the per-expert count exchange before dispatch (E int64 per rank), routing weights and
      indices sent beside the payload, any padding to a capacity, and quantisation scales.
    Raises ValueError naming the field, value and what is allowed: ep or hidden_size not an int >= 1,
      an unknown dtype, load_RE empty or not a list of lists, a row whose length differs from the
      first (ragged), a count that is not an int >= 0, E % ep != 0, len(load_RE) % ep != 0.
    """
    int_at_least("hidden_size", hidden_size, 1)
    nbytes = dtype_bytes(dtype)
    return crossing_rows(load_RE, ep) * hidden_size * nbytes * 2 * (2 if backward else 1)


def a2a_per_token(cfg: ModelConfig, *, ep: int, dtype: str = "bf16") -> dict:
    """Forward all-to-all bytes per token per MoE layer, under uniform routing (each of a token's
    K rows lands on any expert with equal probability, so a fraction (ep - 1) / ep leaves its rank).

    {"dtype", "bytes_per_value", "dispatch": K D b (ep - 1) / ep, "combine": the same}; floats,
    the expectation. Equals `a2a_bytes(..., backward=False)` / tokens on uniform counts; the
    backward pass moves as much again. Shared experts are not dispatched. Raises ValueError
    (an ep `check_ep` refuses, unknown dtype)."""
    check_ep(ep, None, cfg, name="ep")
    nbytes = dtype_bytes(dtype)
    one_way = cfg.num_experts_per_tok * cfg.hidden_size * nbytes * (ep - 1) / ep
    return {"dtype": dtype_name(dtype), "bytes_per_value": nbytes, "dispatch": one_way, "combine": one_way}


def check_ep(ep: int, world_size: int | None, cfg: ModelConfig, *, name: str = "--ep",
             world: str | None = None) -> None:
    """Refuse an expert-parallel size `ep` that is not an int >= 1, or, above 1: that does not divide the
    `world_size` GPUs a ledger lays out (`world` names them, e.g. "--gpus = 8"; world_size None: no count to
    divide), the routed experts, or that is asked of a model without MoE layers. A run's process count is not
    checked here: `glm5lab.parallel.context_parallel.check_mesh` is its one rule (dp x cp x ep). Raises ValueError
    in `glm5lab.validate`'s form, named `name` (`--ep = VALUE is not allowed: RULE`)."""
    int_at_least(name, ep, 1)
    if ep == 1:
        return
    if world_size is not None and world_size % ep:
        refuse(name, ep, "a divisor of " + (world or f"{world_size} GPUs"))
    if not cfg.n_routed_experts or "sparse" not in cfg.mlp_layer_types:
        refuse(name, ep, f"1 for a model without MoE layers (n_routed_experts {cfg.n_routed_experts}, "
               f"mlp_layer_types {sorted(set(cfg.mlp_layer_types))})")
    if cfg.n_routed_experts % ep:
        refuse(name, ep, f"a divisor of the routed experts, n_routed_experts = {cfg.n_routed_experts}")


def _check_load(load_RE, ep: int) -> int:
    """E (the row length) after checking `load_RE` and `ep` (see `a2a_bytes`)."""
    int_at_least("ep", ep, 1)
    if not isinstance(load_RE, (list, tuple)) or not load_RE or not isinstance(load_RE[0], (list, tuple)):
        refuse("load_RE", load_RE, "a non-empty list of lists, one per world rank, of E ints each")
    E = len(load_RE[0])
    if E == 0:
        refuse("len(load_RE[0])", 0, "E >= 1 (one count per routed expert)")
    for r, row in enumerate(load_RE):
        if not isinstance(row, (list, tuple)) or len(row) != E:
            refuse(f"load_RE[{r}]", row, f"a list of E = {E} counts, as long as load_RE[0] (ragged rows)")
        for e, n in enumerate(row):
            if not is_int(n) or n < 0:
                refuse(f"load_RE[{r}][{e}]", n, "an int >= 0 (rows routed to expert e)")
    if E % ep:
        refuse("ep", ep, f"a divisor of the number of routed experts E = {E}")
    if len(load_RE) % ep:
        refuse("len(load_RE)", len(load_RE), f"a multiple of ep = {ep} (world ranks = data x expert)")
    return E
