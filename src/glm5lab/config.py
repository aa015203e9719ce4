"""`ModelConfig`: one flat, typed description of a GLM-5-family model.

Field names are those of the HF `glm_moe_dsa` config.json (transformers' `GlmMoeDsaConfig`), so a
real GLM-5 `config.json` maps onto it field for field. The fields after `pad_token_id` are
glm5lab's own switches for what the report ablates; they are written into config.json too
(transformers keeps unknown keys as attributes and ignores them).

Conversion to and from config.json lives in `glm5lab.hf_config`; named presets in
`glm5lab.presets` (both plain data and functions: they import nothing of this module). Every check (construction, `replace`, `from_preset`, `from_hf`) raises
`ConfigError` naming the field, the value and what is allowed: every field's type is checked
(integers must be `int`, not 64.0; switches real bools; floats finite), then its range.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from glm5lab import hf_config, presets
from glm5lab.validate import ConfigError, finite, int_at_least, is_int, one_of, refuse

ATTENTION_TYPES = ("mla", "gqa")
MIXER_TYPES = ("attention", "swa", "gdn", "simple_gdn")
MIXER_ALIASES = {"full": "attention"}
"""Accepted on input and stored under the new name ("full" was the name of "attention" until
glm5lab 0.1; it clashed with the "full" of `indexer_types`)."""
SIMPLE_GDN_DECAYS = ("learned", "constant")
INDEXER_TYPES = ("full", "shared")
INDEXER_TARGETS = ("own", "served")
"""What a kept indexer learns in training (`Stage.indexer_target`): "own" its layer's attention; "served" the
layers it serves (multi-layer distillation, `glm5lab.model.index_distill`)."""
MLP_LAYER_TYPES = ("dense", "sparse")
FIRST_K_DENSE_REPLACE = 3
"""Leading dense layers when neither `first_k_dense_replace` nor `mlp_layer_types` is given (GLM-5's, as
transformers' GlmMoeDsaConfig defaults)."""
HIDDEN_ACTS = ("silu",)
BOOL_FIELDS = ("norm_topk_prob", "attention_bias", "tie_word_embeddings", "use_dsa", "rope_interleave",
               "indexer_rope_interleave", "use_qk_norm")


def _fail(name: str, value, allowed: str):
    refuse(f"config field `{name}`", value, allowed, ConfigError)


@dataclass
class ModelConfig:
    """Architecture of a GLM-5-family causal LM (defaults: the published GLM-5, 744B).

    Per-layer lists (`attention_types`, `indexer_types`, `mlp_layer_types`, `mixer_types`) have one entry per
    main layer (`num_hidden_layers`); `None` means "derive the default" and is resolved in `__post_init__`, so
    after construction they are always lists. The MTP layer (layer index `num_hidden_layers` in the
    checkpoint) copies the last main layer's attention and MLP kind and always runs its own indexer.

    `mlp_layer_types` and `first_k_dense_replace` describe one thing; give either or both in agreement. Given
    alone, `mlp_layer_types` sets `first_k_dense_replace` to its number of leading dense layers (any pattern is
    allowed, as in transformers; the serving stacks read only `first_k_dense_replace`, so they see a dense prefix
    only); `first_k_dense_replace` alone (default 3, GLM-5's and transformers') derives `mlp_layer_types` as that
    many dense layers, then sparse ones. Both given, `first_k_dense_replace` must equal the list's leading dense
    layers (what `to_hf` writes, and what GLM-5's config.json carries when it holds both): a conflict is refused,
    naming both, where transformers would use the list and ignore the number without a word.
    Raises ConfigError (see the module docstring); floats are stored as `float`.
    """

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int | None = None
    mlp_layer_types: list[str] | None = None
    index_topk: int = 2048
    index_n_heads: int = 32
    index_head_dim: int = 128
    indexer_types: list[str] | None = None
    num_nextn_predict_layers: int = 1
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    # --- glm5lab switches (what the report ablates) ---
    attention_types: list[str] | None = None
    """Per main layer: "mla" (GLM-5) or "gqa" (baseline with `num_key_value_heads` KV heads,
    per-head q/k width `qk_head_dim` with RoPE on its last `qk_rope_head_dim` dims, v width
    `v_head_dim`)."""
    use_dsa: bool = True
    """Sparse attention on MLA layers: keep only the indexer's `index_topk` keys per query.
    False = dense attention; indexer weights are still built (when `index_n_heads` > 0) so a
    dense model can be warmed up into DSA and still loads in transformers."""
    mtp_depth: int = 3
    """How many times the one shared MTP module is unrolled in training (D in the report)."""
    rope_interleave: bool = True
    """RoPE pairing in MLA/GQA: True = interleaved pairs (x0,x1),(x2,x3).. as GLM-5; False = half split."""
    indexer_rope_interleave: bool = True
    """RoPE pairing in the indexer: True for GLM-5, False for DeepSeek-V3.2's indexer."""
    use_qk_norm: bool = False
    """GQA layers only: RMSNorm on each q/k head (GLM-4.5)."""
    mixer_types: list[str] | None = None
    """Per main layer, how it mixes tokens: "attention" (causal attention, with DSA on MLA layers;
    "full" is accepted as an old alias), "swa" (sliding-window attention: each query sees exactly
    its last min(position + 1, `sliding_window`) keys, dense, no DSA selection), "gdn" (a Gated
    DeltaNet layer in place of attention, `linear_*` fields) or "simple_gdn" (GQA layers only: the
    gated delta rule fed by the layer's own q/k/v/o projections). Default: all "attention". What
    each layer then does with indexer weights and index state is resolved once in `layers`
    (`LayerSpec`). (transformers' glm_moe_dsa ignores this field: export only "attention"/"swa"
    models there; "swa" layers load there as full attention.)"""
    sliding_window: int | None = None
    """Keys per query on "swa" layers; an integer >= 1, required when any layer is "swa"."""
    linear_num_value_heads: int | None = None
    """"gdn" layers (Gated DeltaNet, `glm5lab.model.gdn_layer`): value heads, one recurrent state
    each (default num_attention_heads). Names as transformers' Qwen3-Next config."""
    linear_num_key_heads: int | None = None
    """"gdn" layers: q/k heads, a divisor of the value heads (default: the value heads)."""
    linear_key_head_dim: int | None = None
    """"gdn" layers: q/k head width (default qk_head_dim)."""
    linear_value_head_dim: int | None = None
    """"gdn" layers: value head width (default v_head_dim)."""
    linear_conv_kernel_dim: int = 4
    """"gdn" layers: width of the causal depthwise conv on q/k/v."""
    simple_gdn_decay: str = "learned"
    """"simple_gdn" layers (the GQA layer's q/k/v/o feeding the gated delta rule): "learned" =
    decay and write strength computed from the token (small per-head projections), "constant" =
    learned per-head scalars. The report does not publish its choice."""
    hf_extra: dict = field(default_factory=dict)
    """config.json keys glm5lab does not interpret, kept so a save writes them back unchanged."""

    def __post_init__(self):
        self._check_types()
        n = self.num_hidden_layers
        if self.attention_types is None:
            self.attention_types = ["mla"] * n
        given_k = self.first_k_dense_replace  # None: not given
        if self.mlp_layer_types is None:
            k = FIRST_K_DENSE_REPLACE if given_k is None else given_k
            if k > n:
                _fail("first_k_dense_replace", k, f"at most num_hidden_layers={n}")
            self.mlp_layer_types = ["dense"] * k + ["sparse"] * (n - k)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * n
        if self.mixer_types is None:
            self.mixer_types = ["attention"] * n
        elif isinstance(self.mixer_types, (list, tuple)):
            self.mixer_types = [MIXER_ALIASES.get(m, m) if isinstance(m, str) else m for m in self.mixer_types]
        for name, allowed in (("attention_types", ATTENTION_TYPES), ("indexer_types", INDEXER_TYPES),
                              ("mlp_layer_types", MLP_LAYER_TYPES), ("mixer_types", MIXER_TYPES)):
            _check_layer_list(self, name, allowed)
        # first_k_dense_replace follows the list (serving stacks read only it); given, it must agree
        self.first_k_dense_replace = next((i for i, t in enumerate(self.mlp_layer_types) if t != "dense"), n)
        if given_k is not None and given_k != self.first_k_dense_replace:
            _fail("first_k_dense_replace", given_k, f"{self.first_k_dense_replace} with mlp_layer_types = "
                  f"{self.mlp_layer_types} (its leading dense layers): the two describe the same layers; give one "
                  "of them, or both in agreement")
        self._check_shapes()
        self._check_moe()
        self._check_dsa()
        self._check_window()
        self._check_linear()

    def _check_types(self):
        _integers(self, 1, "num_hidden_layers", "vocab_size", "hidden_size", "num_attention_heads",
                  "num_key_value_heads", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
                  "mtp_depth", "index_topk")
        _integers(self, 0, "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank",
                  "qk_nope_head_dim", "n_routed_experts", "n_shared_experts", "index_n_heads", "index_head_dim",
                  "num_nextn_predict_layers", "num_experts_per_tok", "n_group",
                  "topk_group")
        if self.first_k_dense_replace is not None:
            _integers(self, 0, "first_k_dense_replace")
        _numbers(self, positive=True, names=("rope_theta", "rms_norm_eps", "routed_scaling_factor"))
        _numbers(self, positive=False, names=("initializer_range",))
        for name in BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "True or False (a JSON boolean)")
        _check_token_ids(self)
        if not isinstance(self.hf_extra, dict):
            _fail("hf_extra", self.hf_extra, "a dict of config.json keys")

    def _check_shapes(self):
        one_of("config field `hidden_act`", self.hidden_act, HIDDEN_ACTS, error=ConfigError)
        if self.qk_rope_head_dim % 2:
            _fail("qk_rope_head_dim", self.qk_rope_head_dim, "an even number (RoPE rotates pairs)")
        if self.num_attention_heads % self.num_key_value_heads:
            _fail("num_key_value_heads", self.num_key_value_heads,
                  f"a divisor of num_attention_heads={self.num_attention_heads}")
        if "mla" in self.attention_types:
            for name in ("q_lora_rank", "kv_lora_rank"):
                if getattr(self, name) < 1:
                    _fail(name, getattr(self, name), "at least 1 when any layer is MLA")
        if self.num_nextn_predict_layers > 1:
            _fail("num_nextn_predict_layers", self.num_nextn_predict_layers,
                  "0 or 1 (GLM-5 shares one MTP module across depths)")

    def _check_moe(self):
        if "sparse" in self.mlp_layer_types:
            _integers(self, 1, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
                      "topk_group")
            if self.n_routed_experts % self.n_group:
                _fail("n_group", self.n_group, f"a divisor of n_routed_experts={self.n_routed_experts}")
            if self.topk_group > self.n_group:
                _fail("topk_group", self.topk_group, f"at most n_group={self.n_group}")
            reachable = self.topk_group * (self.n_routed_experts // self.n_group)
            if self.num_experts_per_tok > reachable:
                _fail("num_experts_per_tok", self.num_experts_per_tok,
                      f"at most n_routed_experts={self.n_routed_experts} (and at most "
                      f"topk_group * experts per group = {reachable})")
            if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                _fail("n_group", self.n_group, "groups of at least 2 experts (group score = sum of top-2)")

    def _check_dsa(self):
        if self.has_indexer_weights:
            if self.index_head_dim < self.qk_rope_head_dim:
                _fail("index_head_dim", self.index_head_dim, f"at least qk_rope_head_dim={self.qk_rope_head_dim}")
            if "mla" not in self.attention_types:
                _fail("index_n_heads", self.index_n_heads, "0 when no layer is MLA (DSA runs on MLA layers)")
        elif self.use_dsa:
            _fail("use_dsa", True, "False when index_n_heads is 0 (no indexer to select keys)")
        for spec in self.layers:
            if spec.indexer == "shared" and spec.reuses_from is None:
                _fail(f"indexer_types[{spec.index}]", "shared", "'full' for the first MLA layer that selects keys (a "
                      "shared layer reuses the top-k of an earlier full layer; 'swa', 'gdn' and 'simple_gdn' layers "
                      "select none)")

    def _check_linear(self):
        for name in ("linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                _fail(name, value, "None (derive) or an integer >= 1")
        _integers(self, 1, "linear_conv_kernel_dim")
        hv, hk, _, _ = self.gdn_dims
        if hv % hk:
            _fail("linear_num_key_heads", hk, f"a divisor of linear_num_value_heads={hv}")
        one_of("config field `simple_gdn_decay`", self.simple_gdn_decay, SIMPLE_GDN_DECAYS, error=ConfigError)
        for i, (mixer, attn) in enumerate(zip(self.mixer_types, self.attention_types, strict=False)):
            if mixer == "simple_gdn" and attn != "gqa":
                _fail(f"mixer_types[{i}]", mixer, f"'simple_gdn' only on GQA layers (it reuses their q/k/v/o "
                      f"projections); attention_types[{i}] is {attn!r}")

    @property
    def gdn_dims(self) -> tuple[int, int, int, int]:
        """(value heads, key heads, key width, value width) of "gdn" layers, defaults resolved."""
        hv = self.linear_num_value_heads or self.num_attention_heads
        return (hv, self.linear_num_key_heads or hv, self.linear_key_head_dim or self.qk_head_dim,
                self.linear_value_head_dim or self.v_head_dim)

    def _check_window(self):
        w = self.sliding_window
        if w is not None and (not is_int(w) or w < 1):
            _fail("sliding_window", w, "None or an integer >= 1")
        if "swa" in self.mixer_types and w is None:
            _fail("sliding_window", w, "an integer >= 1 when any of mixer_types is 'swa'")

    @property
    def has_indexer_weights(self) -> bool:
        """The config builds lightning indexers (index_n_heads > 0 and index_head_dim > 0). Which
        layer holds one and which runs it: `layers`."""
        return self.index_n_heads > 0 and self.index_head_dim > 0

    @property
    def layers(self) -> tuple[LayerSpec, ...]:
        """What each main layer is, resolved once from the per-layer lists (`LayerSpec`). Every
        consumer (model, cache, ledger, IndexCache search) reads this, not the lists."""
        return resolve_layers(self)

    @property
    def mtp_layer(self) -> LayerSpec | None:
        """The MTP layer's `LayerSpec` (checkpoint index `num_hidden_layers`), None without one."""
        return mtp_spec(self) if self.num_nextn_predict_layers else None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Values cached per token per MLA layer: latent + shared RoPE key (512 + 64 = 576 in GLM-5)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def gqa_cache_width(self) -> int:
        """Values cached per token per GQA layer: K and V of every KV head."""
        return self.num_key_value_heads * (self.qk_head_dim + self.v_head_dim)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with `changes` applied and validated. A per-layer list that was not given is
        re-derived when a field it derives from changes: `num_hidden_layers` -> all four lists,
        `first_k_dense_replace` -> `mlp_layer_types`; and a new `mlp_layer_types` list re-derives
        `first_k_dense_replace` unless that is given too. Raises ConfigError (unknown field, bad value)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}: see `ModelConfig`")
        derived = [name for src, names in _DERIVED_FROM.items() if src in changes for name in names]
        if changes.get("mlp_layer_types") is not None:  # a new list: first_k_dense_replace follows it
            derived.append("first_k_dense_replace")
        for name in derived:
            changes.setdefault(name, None)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        """The named preset (see `glm5lab.presets.PRESETS`), with `overrides` (fields) applied
        and validated as `replace` does.

        Raises ConfigError for an unknown name (listing the known ones) or a bad override."""
        if name not in presets.PRESETS:
            raise ConfigError(f"unknown preset {name!r}: choose one of {', '.join(presets.PRESETS)}")
        cfg = cls(**presets.PRESETS[name]())
        return cfg.replace(**overrides) if overrides else cfg

    @classmethod
    def from_hf(cls, path_or_dict) -> "ModelConfig":
        """Parse an HF `config.json` (a path to the file or its folder, or the dict).

        Accepts the GLM-5 one unchanged, with its aliases (`index_topk_freq`,
        `index_skip_topk_offset`, `index_topk_pattern`, `rope_theta`/`rope_parameters`).
        Raises ConfigError for another `model_type`, an unsupported setting or an unknown key
        (`glm5lab.hf_config.fields_from_hf`); FileNotFoundError when the file is missing."""
        try:
            return cls(**hf_config.fields_from_hf(path_or_dict, {f.name: f.default for f in dataclasses.fields(cls)}))
        except (TypeError, ValueError, AttributeError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"config.json has a value of the wrong type: {e}") from None

    def to_hf(self) -> dict:
        """The HF `config.json` dict (`model_type` `glm_moe_dsa`) for this config."""
        return hf_config.config_to_hf(self)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer, as every part of glm5lab sees it (`ModelConfig.layers`).

    index: checkpoint layer index (`num_hidden_layers` for the MTP layer).
    attention: "mla" | "gqa", the projection family whose weights the layer holds ("simple_gdn"
      layers hold a GQA layer's q/k/v/o).
    mixer: "attention" | "swa" | "gdn" | "simple_gdn" (`ModelConfig.mixer_types`). window: keys per query on an
    "swa" layer, else None. indexer: where the layer's DSA top-k comes from when DSA is on: "own" (its lightning
      indexer: an MLA "attention" layer whose `indexer_types` entry is "full"), "shared" (the
      top-k of the last earlier "own" layer, `reuses_from`: IndexCache), "none" (GQA, SWA and
      Gated DeltaNet layers never select keys).
    has_indexer_weights: the layer holds a `LightningIndexer`: "own" layers, and MLA "swa" layers
      whose `indexer_types` entry is "full". Those keep the weights (a checkpoint written for
      full attention, as transformers reads every glm_moe_dsa layer, loads unchanged, and an SWA
      variant of a trained model keeps them) but never run them: no index state, no indexer
      FLOPs, and a later "shared" layer reuses the last "own" layer's top-k, not theirs.
    index_cache: the KV cache keeps this layer's indexer keys ("own" and the config's `use_dsa`). reuses_from:
    for a "shared" layer, the index of the "own" layer whose top-k it reuses. mlp: "dense" | "sparse" (MoE).
    """

    index: int
    attention: str
    mixer: str
    window: int | None
    indexer: str
    has_indexer_weights: bool
    index_cache: bool
    reuses_from: int | None
    mlp: str

    @property
    def recurrent(self) -> bool:
        """A Gated DeltaNet mixer: a fixed-size state instead of per-token cache entries."""
        return self.mixer in ("gdn", "simple_gdn")


def resolve_layers(cfg: ModelConfig) -> tuple[LayerSpec, ...]:
    """`ModelConfig.layers` (see `LayerSpec`). A "shared" layer with no earlier "own" layer gets
    reuses_from None (the config refuses it)."""
    specs, last_own = [], None
    rows = zip(cfg.attention_types, cfg.mixer_types, cfg.indexer_types, cfg.mlp_layer_types, strict=True)
    for i, (attention, mixer, indexer_type, mlp) in enumerate(rows):
        selects = attention == "mla" and mixer == "attention" and cfg.has_indexer_weights
        role = ("own" if indexer_type == "full" else "shared") if selects else "none"
        weights = cfg.has_indexer_weights and attention == "mla" and mixer in ("attention", "swa") \
            and indexer_type == "full"
        specs.append(LayerSpec(i, attention, mixer, cfg.sliding_window if mixer == "swa" else None, role, weights,
                               role == "own" and cfg.use_dsa, last_own if role == "shared" else None, mlp))
        last_own = i if role == "own" else last_own
    return tuple(specs)


def mtp_spec(cfg: ModelConfig) -> LayerSpec:
    """The MTP layer: the last main layer's attention and MLP kind, plain causal attention, and
    its own indexer when that attention is MLA and the config has indexer weights."""
    attention, n = cfg.attention_types[-1], cfg.num_hidden_layers
    own = attention == "mla" and cfg.has_indexer_weights
    return LayerSpec(n, attention, "attention", None, "own" if own else "none", own, own and cfg.use_dsa, None,
                     cfg.mlp_layer_types[-1])


_DERIVED_FROM = {
    "num_hidden_layers": ("attention_types", "indexer_types", "mlp_layer_types", "mixer_types"),
    "first_k_dense_replace": ("mlp_layer_types",),
}


def _integers(cfg, lo: int, *names):
    for name in names:
        int_at_least(f"config field `{name}`", getattr(cfg, name), lo, error=ConfigError)


def _numbers(cfg, *, positive: bool, names):
    for name in names:
        setattr(cfg, name, finite(f"config field `{name}`", getattr(cfg, name), positive=positive, error=ConfigError))


def _check_token_ids(cfg):
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(cfg, name)
        many = name == "eos_token_id" and isinstance(value, (list, tuple))
        ids = list(value) if many else [value]
        if value is not None and not all(is_int(i) and i >= 0 for i in ids):
            lists = ", or a list of integers >= 0" if name == "eos_token_id" else ""
            _fail(name, value, f"an integer >= 0 or None{lists}")
        if many:
            setattr(cfg, name, ids)


def _check_layer_list(cfg, name, allowed):
    values = getattr(cfg, name)
    if not isinstance(values, (list, tuple)) or len(values) != cfg.num_hidden_layers:
        _fail(name, values, f"a list of {cfg.num_hidden_layers} entries (one per layer), each one of {allowed}")
    for i, v in enumerate(values):
        one_of(f"config field `{name}[{i}]`", v, allowed, error=ConfigError)
    setattr(cfg, name, list(values))
