"""Training-free model variants for the searches: the same weights under another layer pattern.

`model_variant(model, **changes)` builds `GLM5ForCausalLM(model.config.replace(**changes))` on the
meta device and gives it the original's parameter and buffer tensors (`load_state_dict(assign=True)`:
shared, not copied). Weights of modules the new pattern no longer has (the indexer of a layer switched to
"shared") are left out; a module the new pattern needs but the model lacks (a layer switched from "shared" to
"full": an indexer without weights) is refused. `mean_nll` is the loss both searches score with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def model_variant(model, **changes):
    """A twin of `model` (GLM5ForCausalLM) with config fields `changes`, sharing its tensors, in
    the same train/eval mode. Raises ConfigError (a ValueError) for an invalid config, ValueError
    when the variant needs weights the model does not have (listing the keys)."""
    cfg = model.config.replace(**changes)
    with torch.device("meta"):
        twin = type(model)(cfg)
    state = model.state_dict()
    wanted = twin.state_dict().keys()
    missing = sorted(set(wanted) - set(state))
    if missing:
        raise ValueError(f"the variant {changes} needs weights the model does not have: {missing[:8]}"
                         + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    twin.load_state_dict({k: state[k] for k in wanted}, strict=True, assign=True)
    return twin.train(model.training)


@torch.no_grad()
def mean_nll(model, ids_BT: torch.Tensor, last: int | None = None) -> float:
    """Mean next-token NLL in nats/token of ids_BT[:, 1:] given the prefix (one forward, fp32
    log-probabilities, summed in fp64), or of each row's `last` targets only."""
    logits_BTV = model(ids_BT[:, :-1]).logits.float()
    targets_BT = ids_BT[:, 1:]
    if last is not None:
        logits_BTV, targets_BT = logits_BTV[:, -last:], targets_BT[:, -last:]
    nll = F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), targets_BT.reshape(-1), reduction="sum")
    return float(nll.double()) / targets_BT.numel()
