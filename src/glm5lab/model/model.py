"""`GLM5ForCausalLM`: embedding, decoder blocks chosen per layer from the config, final norm,
output head, and the shared-parameter MTP module.

Legend: B batch, T positions, D hidden, V vocab. Parameter names equal transformers' `GlmMoeDsaForCausalLM`
except the routed experts (kept as 3-D tensors here) and the MTP layer (`model.mtp_layers.0` here,
`model.layers.{N}` in the checkpoint); `glm5lab.hf` holds the mapping. Single device, no globals: FSDP,
compile and activation checkpointing are applied from outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from glm5lab.config import INDEXER_TARGETS, ModelConfig
from glm5lab.model.block import DecoderLayer
from glm5lab.model.cache import KVCache
from glm5lab.model.gdn_layer import GatedDeltaNet, SimpleGDN
from glm5lab.model.index_distill import check_served, distill_loss
from glm5lab.model.local import local
from glm5lab.model.mla import ATTN_IMPLS
from glm5lab.model.moe import EXPERT_IMPLS, Experts, Router
from glm5lab.model.mtp import MTPLayer, mtp_unroll
from glm5lab.model.norm import RMSNorm
from glm5lab.model.rope import rope_angles
from glm5lab.model.step import Step
from glm5lab.validate import int_at_least, one_of


@dataclass
class CausalLMOutput:
    """logits [B, T, V]; mtp_logits[j-1] [B, T-j, V] predicts token t+j+1 (empty unless asked);
    hidden_states [B, T, D] after the final norm (the MTP module's h^(0))."""

    logits: torch.Tensor
    hidden_states: torch.Tensor
    mtp_logits: list[torch.Tensor] = field(default_factory=list)
    indexer_loss: torch.Tensor | None = None
    """Mean DSA indexer KL over the layers with an indexer (when asked); the MTP layer, when run,
    counts as one layer (its KL averaged over depths)."""


class GLM5Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, spec) for spec in cfg.layers])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mtp_layers = nn.ModuleList([MTPLayer(cfg) for _ in range(cfg.num_nextn_predict_layers)])


class GLM5ForCausalLM(nn.Module):
    """The GLM-5 causal LM. `GLM5ForCausalLM(config)` builds it with random weights (normal,
    std `initializer_range`; norms 1; biases and router bias 0) on the current default device;
    build under `torch.device("meta")` to count a full-size model without memory."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = GLM5Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.layer_specs = tuple(layer.spec for layer in self.model.layers)
        """The `LayerSpec`s the main layers were built from (what `KVCache.for_model` allocates for)."""
        self.mtp_specs = tuple(layer.spec for layer in self.model.mtp_layers)
        self.reset_parameters(constructing=True)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None, *, constructing: bool = False) -> None:
        """Draw every parameter and buffer afresh: normal(0, initializer_range) for linear, embedding, expert and
        router weights; norms 1; biases and the router bias 0; the short convolution as torch's `Conv1d` init; the
        GDN layers' decays (`reset_decay`). Each tensor's local part is written (a sharded DTensor's own shard:
        `glm5lab.parallel.dist.materialize`), in module order, from `generator` (None: the device's global one).
        constructing: the constructor's call, after the modules drew their own (convolution, decays: left as
        drawn), so that `torch.manual_seed(s); GLM5ForCausalLM(cfg)` is the seeded init."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                local(m.weight).normal_(0.0, std, generator=generator)
                if getattr(m, "bias", None) is not None:
                    local(m.bias).zero_()
            elif isinstance(m, (RMSNorm, nn.LayerNorm)):  # RMSNormGated is an RMSNorm
                local(m.weight).fill_(1.0)
                if getattr(m, "bias", None) is not None:
                    local(m.bias).zero_()
            elif isinstance(m, Experts):
                for p in (m.gate_proj, m.up_proj, m.down_proj):
                    local(p).normal_(0.0, std, generator=generator)
            elif isinstance(m, Router):
                local(m.weight).normal_(0.0, std, generator=generator)
                local(m.e_score_correction_bias).zero_()
            elif isinstance(m, nn.Conv1d) and not constructing:  # kaiming_uniform(a=sqrt(5)): bound 1/sqrt(fan_in)
                bound = 1 / math.sqrt(math.prod(m.weight.shape[1:]))
                for p in (q for q in (m.weight, m.bias) if q is not None):
                    local(p).uniform_(-bound, bound, generator=generator)
            elif isinstance(m, (GatedDeltaNet, SimpleGDN)) and not constructing:
                m.reset_decay(generator)

    def forward(self, input_ids: torch.Tensor, *, mtp_depth: int = 0, attn_impl: str = "auto",
                moe_impl: str = "auto", use_dsa: bool | None = None, indexer_loss: bool = False,
                cache: KVCache | None = None, logits_to_keep: int = 0, context_parallel=None,
                indexer_target: str = "own") -> CausalLMOutput:
        """input_ids: int64 [B, T] with 1 <= T <= max_position_embeddings, ids in the vocab.

        cache: a `KVCache.for_model(self, ...)`; input_ids are then each row's next T tokens, at positions
        cache.lengths[b] + 0..T-1; their latents are appended and every row's length grows by T (roll back with
        `cache.truncate`). Raises CacheOverflowError past its capacity. logits_to_keep: compute logits for the
        last this-many positions only (0 = all), as in transformers (prefill needs one row of logits, not T).

        mtp_depth: unroll the MTP module this many times (0 = none; needs
        num_nextn_predict_layers = 1). attn_impl: "auto" (`glm5lab.model.mla.attention_route`) |
        "naive" (every mixer's reference kernel) | "absorbed" (MLA: latent-space attention);
        moe_impl: "auto" (a sync-free path when at most 16 tokens decode: `torch._grouped_mm`, or
        gathered expert weights where it does not run; tiled grouped otherwise) | "grouped" |
        "grouped_mm" | "gathered" | "loop" (the reference; see `glm5lab.model.moe`). use_dsa: override the config's switch for this call
        (training stages). indexer_loss: also compute the DSA indexer KL (`MLAttention.indexer_kl`): the mean
        over the "own" indexer layers (the MTP layer counting as one). indexer_target (with indexer_loss): "own",
        each own layer's indexer learns its layer's attention; "served", multi-layer distillation, it learns the
        mean attention of the layers it serves (itself and the "shared" layers after it: IndexCache's
        training-aware loss, `glm5lab.model.index_distill`; not with context_parallel).
        context_parallel: a `glm5lab.parallel.context_parallel.ContextParallel` (training, uncached): every rank
        of its group passes the whole sequence's input_ids and gets its own tokens' outputs only: logits and
        hidden_states [B, T / cp, ...] at `context_parallel.positions(T)`, MTP depth j's logits at those of them
        below T - j (a prefix), and the indexer loss as this rank's share (`ContextParallel.group_mean`: the
        group's mean is one process's value). MLA and GQA full-attention layers only. Checks everything, the ids' range included (one host synchronisation); the per-token
        path of `glm5lab.infer` calls `step`, which checks shapes only. Raises ValueError on bad
        ids/shapes/options, TypeError on wrong types."""
        self._check_input(input_ids, mtp_depth)
        if cache is not None and (mtp_depth or indexer_loss):
            raise ValueError("mtp_depth and indexer_loss are training options: not available with a cache "
                             "(speculative drafting runs the MTP layer through `mtp_step`)")
        if cache is not None:
            cache.check_layers(self.layer_specs, "KVCache.for_model(model, ...)")
            if cache.batch != input_ids.shape[0]:
                raise ValueError(f"input_ids has {input_ids.shape[0]} rows but the cache was built for {cache.batch}")
        options = dict(mtp_depth=mtp_depth, attn_impl=attn_impl, moe_impl=moe_impl, use_dsa=use_dsa,
                       indexer_loss=indexer_loss, logits_to_keep=logits_to_keep, indexer_target=indexer_target)
        if context_parallel is not None:
            self._check_context_parallel(input_ids, cache, logits_to_keep, context_parallel)
            return self.step(input_ids, None, context_parallel=context_parallel, **options)
        if cache is None:
            return self.step(input_ids, None, **options)
        with cache.writing(input_ids.shape[1]):
            return self.step(input_ids, cache, **options)

    def step(self, input_ids: torch.Tensor, cache: KVCache | None, *, mtp_depth: int = 0, attn_impl: str = "auto",
             moe_impl: str = "auto", use_dsa: bool | None = None, indexer_loss: bool = False,
             logits_to_keep: int = 0, static: bool = False, context_parallel=None,
             indexer_target: str = "own") -> CausalLMOutput:
        """`forward` without its checks of the ids' values and shapes (the caller made them once:
        `glm5lab.infer.prefill` / `decode_step` / `verify`); no host synchronisation on the way. With a cache,
        call it inside `cache.writing(T)` (which reserves and commits the tokens). Options as `forward`;
        raises ValueError for an unknown option value. static (with a cache): static shapes, keys over the
        whole capacity (`KVCache.begin`), the form `torch.compile` traces (`glm5lab.infer.compiled`).
        context_parallel: as `forward` (uncached; input_ids the whole sequence)."""
        cfg, T = self.config, input_ids.shape[1]
        options = self._options(attn_impl, moe_impl, use_dsa, indexer_loss, indexer_target)
        check_served(indexer_target, context_parallel)
        int_at_least("logits_to_keep (0 = all positions)", logits_to_keep, 0)
        cp, own_ids = context_parallel, input_ids
        if cp is not None:  # this rank's tokens at their global positions
            positions = cp.positions(T, device=input_ids.device)
            own_ids = input_ids.index_select(1, positions)
        else:
            positions = cache.positions(T) if cache is not None else torch.arange(T, device=input_ids.device)
        cos_TR2, sin_TR2 = rope_angles(positions, cfg.qk_rope_head_dim, cfg.rope_theta)
        if cache is not None:
            step = cache.begin(T, cos_TR2, sin_TR2, static=static, **options)
        elif cp is not None:
            step = Step.split(cp, T, positions, cos_TR2, sin_TR2, **options)
        else:
            step = Step.uncached(T, cos_TR2, sin_TR2, **options)
        x_BTD, handoff, kls = self.model.embed_tokens(own_ids), None, []
        for i, layer in enumerate(self.model.layers):  # the last "own" layer's top-k goes on to the "shared" ones
            x_BTD, handoff, kl = layer(x_BTD, step.layer(i, handoff))
            kls += [] if kl is None else [(self.layer_specs[i].indexer, kl)]
        h_BTD = self.model.norm(x_BTD)
        out = CausalLMOutput(logits=self.lm_head(h_BTD[:, -logits_to_keep:]), hidden_states=h_BTD)
        if mtp_depth:
            out.mtp_logits, mtp_kls = mtp_unroll(self.model.mtp_layers[0], self.model.embed_tokens, self.lm_head,
                                                 h_BTD, input_ids, mtp_depth, step)
            if mtp_kls:  # the MTP layer counts as one indexer layer, averaged over its depths
                kls.append(("own", torch.stack(mtp_kls).mean()))
        if kls:  # the mean over own layers (groups: an own layer and the shared ones whose KL it takes)
            out.indexer_loss = distill_loss(kls)
        return out

    def _options(self, attn_impl: str, moe_impl: str, use_dsa: bool | None, indexer_loss: bool,
                 indexer_target: str = "own") -> dict:
        """The `Step` options of one forward. Raises ValueError for an unknown impl or indexer target."""
        one_of("attention impl", attn_impl, ATTN_IMPLS)
        one_of("experts impl", moe_impl, EXPERT_IMPLS)
        one_of("indexer_target", indexer_target, INDEXER_TARGETS)
        return dict(reference=attn_impl == "naive", absorbed=attn_impl == "absorbed", moe_impl=moe_impl,
                    use_dsa=self.config.use_dsa if use_dsa is None else bool(use_dsa),
                    index_topk=self.config.index_topk, indexer_loss=indexer_loss, indexer_target=indexer_target)

    def mtp_step(self, hidden_BTD: torch.Tensor, next_ids: torch.Tensor, *, cache: KVCache,
                 attn_impl: str = "auto", moe_impl: str = "auto", with_logits: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One cached application of the MTP layer (the speculative draft head): for each row's T
        new pairs (h_t, x_{t+1}), returns (h' [B, T, D], logits [B, T, V]) predicting x_{t+2};
        h' is the MTP block's output after `shared_head.norm`, what the logits are computed from.

        hidden_BTD: the main model's `hidden_states` (post final norm) or, for the next draft step, the h' this
        method returned (post-norm at every depth, as in training: see `glm5lab.model.mtp`); next_ids: int64 [B,
        T] (ids not range-checked: they come from the model or from checked prompts); cache:
        `KVCache.for_mtp(self, ...)`, whose entry at slot t is pair t (positions follow the cache, as in
        vLLM/SGLang's MTP drafting). with_logits=False skips the output head (logits None). No host
        synchronisation. Raises ValueError without an MTP layer or for shapes that disagree, CacheOverflowError
        past capacity. `mtp_forward` is the same inside the caller's `cache.writing(T)`, unchecked."""
        self._check_mtp_step(hidden_BTD, next_ids, cache)
        with cache.writing(next_ids.shape[1]):
            return self.mtp_forward(hidden_BTD, next_ids, cache=cache, attn_impl=attn_impl, moe_impl=moe_impl,
                                    with_logits=with_logits)

    def mtp_forward(self, hidden_BTD: torch.Tensor, next_ids: torch.Tensor, *, cache: KVCache, attn_impl: str = "auto",
                    moe_impl: str = "auto", with_logits: bool = True, static: bool = False):
        """`mtp_step` without checks, inside the caller's `cache.writing(T)`; static: as `step`."""
        cfg, T = self.config, next_ids.shape[1]
        cos, sin = rope_angles(cache.positions(T), cfg.qk_rope_head_dim, cfg.rope_theta)
        step = cache.begin(T, cos, sin, static=static, **self._options(attn_impl, moe_impl, None, False))
        h_BTD, _ = self.model.mtp_layers[0](hidden_BTD, self.model.embed_tokens(next_ids), step.layer(0))
        return h_BTD, (self.lm_head(h_BTD) if with_logits else None)

    def _check_context_parallel(self, input_ids: torch.Tensor, cache, logits_to_keep: int, cp) -> None:
        """TypeError when cp is not a `ContextParallel`; ValueError in one line: CP with a cache or logits_to_keep, a
        layer CP does not run (sliding window, Gated DeltaNet, SimpleGDN), or a length the CP layout cannot split
        (`check_split`)."""
        from glm5lab.parallel.context_parallel import ContextParallel, check_split

        if not isinstance(cp, ContextParallel):
            raise TypeError(f"context_parallel must be a glm5lab.parallel.context_parallel.ContextParallel or None, "
                            f"got {type(cp).__name__}")
        if cache is not None or logits_to_keep:
            got = "a cache" if cache is not None else f"logits_to_keep={logits_to_keep}"
            raise ValueError(f"context_parallel is for uncached training forwards: got {got}; allowed: no cache, "
                             "logits_to_keep=0 (every position)")
        for i, spec in enumerate(self.layer_specs + self.mtp_specs):
            if spec.mixer != "attention":
                where = f"layer {i}" if i < len(self.layer_specs) else "the MTP layer"
                raise ValueError(f"context parallelism runs full-attention MLA and GQA layers only: {where} is a "
                                 f"'{spec.mixer}' layer (mixer_types); train it without --cp")
        check_split(input_ids.shape[1], cp.size, cp.layout)

    def _check_mtp_step(self, hidden_BTD: torch.Tensor, next_ids: torch.Tensor, cache: KVCache) -> None:
        if not self.config.num_nextn_predict_layers:
            raise ValueError("this model has no MTP layer (num_nextn_predict_layers=0): nothing to draft with")
        if next_ids.dim() != 2 or cache.batch != next_ids.shape[0] or hidden_BTD.shape[:2] != next_ids.shape:
            raise ValueError(f"mtp_step: hidden {tuple(hidden_BTD.shape)}, next_ids {tuple(next_ids.shape)} and "
                             f"a cache of {cache.batch} rows do not agree ([B, T, D], [B, T], B rows)")
        cache.check_layers(self.mtp_specs, "KVCache.for_mtp(model, ...)")

    def _check_input(self, input_ids: torch.Tensor, mtp_depth: int) -> None:
        """TypeError: `input_ids` not a tensor, `mtp_depth` not an int. ValueError: not an integer
        [B, T] tensor, B = 0, T outside 1..max_position_embeddings, an id outside the vocab, a
        negative `mtp_depth` or one > 0 without an MTP layer."""
        cfg = self.config
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.LongTensor [batch, seq], got {type(input_ids).__name__}; "
                            "wrap it with torch.as_tensor(ids, dtype=torch.long)")
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if B < 1:
            raise ValueError(f"input_ids has {B} rows: a batch needs at least 1 sequence")
        if not 1 <= T <= cfg.max_position_embeddings:
            raise ValueError(f"sequence length {T} is not allowed: 1..max_position_embeddings={cfg.max_position_embeddings}")
        if input_ids.device.type != "meta":
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= cfg.vocab_size:
                raise ValueError(f"token ids must lie in [0, vocab_size={cfg.vocab_size}), got min {lo} max {hi}")
        if not isinstance(mtp_depth, int) or isinstance(mtp_depth, bool):
            raise TypeError(f"mtp_depth must be an int, got {mtp_depth!r} ({type(mtp_depth).__name__})")
        if mtp_depth < 0 or (mtp_depth and cfg.num_nextn_predict_layers == 0):
            raise ValueError(f"mtp_depth={mtp_depth} is not allowed: 0, or >= 1 when the model has an MTP "
                             f"layer (num_nextn_predict_layers={cfg.num_nextn_predict_layers})")

    @classmethod
    def from_pretrained(cls, path, *, dtype: torch.dtype | None = None, device=None, mtp: bool | None = None):
        """Load an HF-layout folder (config.json + safetensors, sharded or not). See `glm5lab.hf.load_pretrained`.

        The loaded model computes transformers' `GlmMoeDsaForCausalLM` logits (fp32: within 1e-4) except at
        exact ties of index scores at a DSA query's top-k boundary: glm5lab keeps the earlier key,
        transformers' `torch.topk` picks among equal scores arbitrarily, so from such a query on the two can
        differ (README, "Parity at index-score ties"). dtype: the router's weight and bias and the indexer's
        `weights_proj`/`k_norm` stay fp32 with the checkpoint's exact values (`glm5lab.model.precision`)."""
        from glm5lab.hf import load_pretrained

        return load_pretrained(cls, path, dtype=dtype, device=device, mtp=mtp)

    def save_pretrained(self, path, *, max_shard_bytes: int = 5 * 2**30) -> Path:
        """Write config.json + safetensors in the layout transformers reads. See `glm5lab.hf.save_pretrained`."""
        from glm5lab.hf import save_pretrained

        return save_pretrained(self, path, max_shard_bytes=max_shard_bytes)
