"""Shared-parameter multi-token prediction (MTP).

Legend: B batch, T positions, D hidden, V vocab, j depth (1..D_mtp).

One module phi (DeepSeek-V3 layout: `enorm`, `hnorm`, `eh_proj`, one decoder block,
`shared_head.norm`; embedding and output head shared with the main model) is applied
recursively, and every depth hands on the state after its final norm:
    h^(0) = the main model's final hidden state, after its final norm
    h^(j)_t = shared_head.norm(Block(eh_proj([enorm(emb(x_{t+j})) ; hnorm(h^(j-1)_t)])))
    logits^(j)_t = lm_head(h^(j)_t)  predicts x_{t+j+1}
So what the output head reads at depth j is also what depth j+1 receives: one kind of input
(post-norm) for the one shared parameter set at every depth. Depth j is computed on positions
t = 0..T-1-j only (where x_{t+j} exists), so its logits are [B, T-j, V]; the last one predicts
the token after the sequence. The same parameters serve every depth: the report's "unrolled 3 times in training",
and the draft head of speculative decoding (`GLM5ForCausalLM.mtp_step` returns h^(j) for the next draft step).

Sources: DeepSeek-V3 section 2.2; GLM-5 report (shared-parameter MTP); the seed's `SharedMTP`
example (the state the head reads is the state that chains; kept as a test). The post-norm chain
is Megatron-LM's, which trained GLM-5: `megatron/core/transformer/multi_token_prediction.py`,
`MultiTokenPredictionLayer._proj_and_transformer_layer` ends with `_postprocess` (its
`final_layernorm`, our `shared_head.norm`) and `MultiTokenPredictionBlock.forward` feeds that
output to the next depth (`mtp_use_repeated_layer` = one shared layer). Serving engines chain the
same state when drafting GLM-5: vLLM (PRs #45895, #47448: "recycle the post-final-norm hidden";
GLM-5.2's acceptance length 3.04 -> 3.46 in ROCm/ATOM PR #1742) and SGLang's `deepseek_nextn`.
"""

from __future__ import annotations

import torch
from torch import nn

from glm5lab.config import ModelConfig
from glm5lab.model.block import DecoderLayer
from glm5lab.model.norm import RMSNorm
from glm5lab.model.step import LayerStep, Step


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """The MTP module: a decoder block (checkpoint layer index `num_hidden_layers`, spec
    `ModelConfig.mtp_layer`: the last main layer's attention and MLP kind, its own indexer on MLA
    with DSA weights) plus `enorm`, `hnorm`, `eh_proj` and `shared_head.norm`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, cfg.mtp_layer)
        self.enorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def forward(self, h_BLD, emb_BLD, step: LayerStep):
        """One depth: (h^(j) [B, L, D], this depth's indexer KL or None) from h^(j-1) [B, L, D] (the main
        model's post-norm hidden state at depth 1, the previous depth's output after) and the next tokens'
        embeddings [B, L, D]. h^(j) is the block output after `shared_head.norm`: the output head's input and
        the next depth's. `step`: this depth's positions and options (uncached in training; the MTP cache's step
        in speculative drafting); the KL is None unless the step asks for `indexer_loss` (see
        `DecoderLayer.forward`). Everything runs inside this call, so wrappers that act on `__call__` (FSDP2
        unsharding, activation checkpointing) cover it."""
        joined_BL2D = torch.cat([self.enorm(emb_BLD), self.hnorm(h_BLD)], dim=-1)
        z_BLD, _, kl = super().forward(self.eh_proj(joined_BL2D), step)
        return self.shared_head.norm(z_BLD), kl


def mtp_unroll(mtp_layer, embed, lm_head, h0_BTD, input_ids_BT, depth: int, step: Step):
    """(logits of depths 1..depth, indexer KLs) from h0_BTD, the main model's hidden state after its final
    norm, and the main forward's uncached `step` (its RoPE angles and options; each depth runs on its own step
    over L = T-j positions): logits[j-1] is [B, T-j, V]; depth j+1 receives depth j's post-norm state. The KL
    list has one entry per depth when the step asks for `indexer_loss` and the layer runs an indexer, else is
    empty. One shared parameter set. Under context parallelism (`step.context_parallel`) input_ids_BT is the
    whole sequence, h0_BTD this rank's tokens, and depth j's logits those of its tokens below T - j. Raises ValueError unless 1 <= depth <= T-1 (depth j reads token t+j)."""
    T = input_ids_BT.shape[1]
    if not 1 <= depth <= T - 1:
        raise ValueError(f"mtp_depth={depth} is not allowed for a sequence of {T} tokens: 1..{T - 1} "
                         "(depth j reads token t+j)")
    h_BLD, logits, kls = h0_BTD, [], []
    for j in range(1, depth + 1):
        depth_step = step.narrowed(T - j)  # under CP: this rank's tokens below T - j, a prefix of its tokens
        h_BLD, kl = mtp_layer(h_BLD[:, :depth_step.T], embed(depth_step.ids_ahead(input_ids_BT, j)),
                              depth_step.layer(0))
        logits.append(lm_head(h_BLD))
        kls += [] if kl is None else [kl]
    return logits, kls
