"""lm-evaluation-harness adapter: the model name "glm5lab" for a glm5lab / HF-layout folder.

Needs the optional extra `pip install -e '.[eval]'` (lm-eval >= 0.4.13). Importing this module
registers the model with lm-eval, so run lm-eval from Python, or through this module's CLI:

    python -m glm5lab.evals.lm_eval_adapter run --model glm5lab \\
        --model_args pretrained=runs/small/checkpoints/step-000420 --tasks hellaswag --limit 20

    import glm5lab.evals.lm_eval_adapter  # registers "glm5lab"
    lm_eval.simple_evaluate(model="glm5lab", model_args="pretrained=DIR,batch_size=8", tasks=[...])

The folder is one `GLM5ForCausalLM.save_pretrained` writes (config.json + safetensors) plus a
`tokenizer.json` (a training checkpoint has both); `tokenizer=PATH` names another tokenizer.json.
The MTP layer is not loaded: scoring and greedy generation use the main model only.

Contracts, as lm-eval's HFLM (`lm_eval/models/huggingface.py`) for a causal model:
- Tokenisation: text is encoded without the tokenizer's special tokens (glm5lab trains on
  documents encoded that way). A (context, continuation) pair is split as `TemplateLM._encode_pair`
  does: trailing spaces of the context move to the continuation, the continuation's tokens are
  those of encode(context + continuation) after the first len(encode(context)). An empty context
  becomes the prefix token `<|endoftext|>` (`prefix_token_id`, which is also `eot_token_id`).
- loglikelihood: (sum of log-softmax(fp32 logits) over the continuation tokens, is_greedy), where
  is_greedy says every continuation token is the argmax (ties: the lowest id) at its position.
- Length: max_length defaults to config.max_position_embeddings. A context + continuation longer
  than max_length + 1 tokens is LEFT-TRUNCATED (as HFLM; a warning is logged): the input is the
  last max_length tokens before the final one. A continuation longer than max_length is refused
  (ValueError). generate_until left-truncates the context to max_length - max_gen_toks tokens.
- loglikelihood_rolling: lm-eval's disjoint rolling windows of max_length tokens, the first one
  conditioned on `<|endoftext|>`; every token is scored exactly once. An empty string scores 0.0.
- generate_until: glm5lab.generate (cached decode); greedy unless do_sample with temperature > 0
  (then seeded by `seed`). A row stops at `<|endoftext|>`, at max_gen_toks, or once its text holds
  one of the `until` strings (`generate(stop_when=)`); the text is cut before the first stop string.
- Batching: requests are sorted longest first and run `batch_size` at a time, right-padded
  (causal attention, DSA top-k over earlier keys only and per-token MoE routing keep padding
  from touching real positions; the test checks batched == one-at-a-time).
- dtype "auto": float32 on CPU, bfloat16 on CUDA (the router and indexer precision values stay fp32, `glm5lab.model.precision`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from glm5lab.infer.generate import generate
from glm5lab.model.model import GLM5ForCausalLM
from glm5lab.data.tokenizer import EOT, load_tokenizer
from glm5lab.validate import default_dtype, torch_device, torch_dtype

log = logging.getLogger(__name__)

GEN_KWARGS = ("do_sample", "temperature", "top_k", "top_p", "until", "max_gen_toks")


def _int_arg(name: str, value, lo: int, hi: int | None = None) -> int:
    """`value` (int or decimal string, as lm-eval's model_args parser gives) as an int in [lo, hi]."""
    try:
        out = int(value) if not isinstance(value, bool) and str(value).strip().lstrip("-").isdigit() else None
    except (TypeError, ValueError):
        out = None
    if out is None or out < lo or (hi is not None and out > hi):
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}={value!r} is not allowed: an integer {span}")
    return out


@register_model("glm5lab")
class GLM5LabLM(TemplateLM):
    """lm-eval `LM` over `GLM5ForCausalLM.from_pretrained(pretrained)` and a tokenizers tokenizer.

    pretrained: the checkpoint folder. tokenizer: a tokenizer.json (or folder holding one); default the
    checkpoint folder. device: "auto" (cuda if available) | "cpu" | "cuda[:N]". dtype: "auto" | "float32" |
    "bfloat16". batch_size: int >= 1 ("auto" is refused). max_length: tokens per forward,
    1..max_position_embeddings (default the latter). max_gen_toks: default generation budget when a task gives
    none. seed: sampling seed. attn_impl: passed to the model ("auto" | "naive" | "absorbed"). Raises
    FileNotFoundError (folder or tokenizer.json missing), ValueError (a bad argument, a tokenizer larger than
    the model's vocabulary or without `<|endoftext|>`)."""

    def __init__(self, pretrained, tokenizer=None, device="auto", dtype="auto", batch_size=1, max_length=None,
                 max_gen_toks: int = 256, seed: int = 1234, attn_impl: str = "auto", max_batch_size=None):
        super().__init__()
        if str(batch_size).startswith("auto"):
            raise ValueError(f"batch_size={batch_size!r} is not allowed: an integer >= 1 (no automatic search)")
        self.batch_size = _int_arg("batch_size", batch_size, 1)
        self._device = torch_device(device)
        self._dtype = torch_dtype(default_dtype(self._device) if dtype == "auto" else dtype)
        self.folder = Path(pretrained)
        self.model = GLM5ForCausalLM.from_pretrained(self.folder, dtype=self._dtype, device=self._device,
                                                     mtp=False).eval()
        cfg = self.model.config
        self.tokenizer = load_tokenizer(Path(tokenizer) if tokenizer is not None else self.folder)
        if self.tokenizer.get_vocab_size() > cfg.vocab_size:
            raise ValueError(f"the tokenizer has {self.tokenizer.get_vocab_size()} tokens but the model's "
                             f"vocab_size is {cfg.vocab_size}: they do not belong together")
        eot = self.tokenizer.token_to_id(EOT)
        if eot is None:
            raise ValueError(f"the tokenizer has no {EOT} token: it is the prefix and stop token here")
        self._eot = eot
        hi = cfg.max_position_embeddings
        self.max_length = hi if max_length is None else _int_arg("max_length", max_length, 1, hi)
        self.max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, 1)
        self.seed = _int_arg("seed", seed, 0)
        self.attn_impl = attn_impl

    # -- what lm-eval reads ----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def tokenizer_name(self) -> str:
        return str(self.folder)

    def get_model_info(self) -> dict:
        return {"model_folder": str(self.folder), "model_dtype": str(self._dtype),
                "model_num_parameters": sum(p.numel() for p in self.model.parameters())}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None,
                   **kwargs) -> list[int]:
        """Token ids of `string`; the tokenizer's special tokens only when add_special_tokens is True."""
        ids = self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)).ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- scoring ---------------------------------------------------------------------------
    def _window(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
        """(model input, continuation): the input is (ctx + cont)[-(max_length + 1):][:-1]."""
        if not cont:
            raise ValueError("a loglikelihood request has an empty continuation: nothing to score")
        if len(cont) > self.max_length:
            raise ValueError(f"continuation of {len(cont)} tokens exceeds max_length={self.max_length}: "
                             "it cannot be scored in one window")
        whole = ctx + cont
        if len(whole) > self.max_length + 1:
            log.warning("context (%d) + continuation (%d) tokens exceed max_length=%d: left-truncated",
                        len(ctx), len(cont), self.max_length)
        return whole[-(self.max_length + 1):][:-1], cont

    @torch.no_grad()
    def _score_rows(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One right-padded forward over `rows` (input ids, continuation ids); per row the summed
        fp32 log-probability of the continuation (its last len(cont) input positions predict it)
        and whether each continuation token is the argmax."""
        P = max(len(inp) for inp, _ in rows)
        ids_BP = torch.full((len(rows), P), self._eot, dtype=torch.long)
        for b, (inp, _) in enumerate(rows):
            ids_BP[b, :len(inp)] = torch.tensor(inp, dtype=torch.long)
        first = min(len(inp) - len(cont) for inp, cont in rows)  # earliest scored position
        logits_BKV = self.model(ids_BP.to(self._device), logits_to_keep=P - first, attn_impl=self.attn_impl).logits
        logp_BKV = F.log_softmax(logits_BKV.float(), dim=-1)
        out = []
        for b, (inp, cont) in enumerate(rows):
            start = len(inp) - len(cont) - first
            logp_CV = logp_BKV[b, start:start + len(cont)]
            target_C = torch.tensor(cont, dtype=torch.long, device=logp_CV.device)
            ll = logp_CV.gather(-1, target_C[:, None]).sum()
            out.append((float(ll), bool((logp_CV.argmax(-1) == target_C).all())))
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: [(cache key or None, context ids, continuation ids)] -> [(logprob, is_greedy)]."""
        order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            scores = self._score_rows([self._window(requests[i][1], requests[i][2]) for i in idx])
            for i, answer in zip(idx, scores, strict=True):
                out[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Full log-likelihood of each string (no truncation) over disjoint rolling windows."""
        windows, owner = [], []
        for r, req in enumerate(requests):
            (string,) = req.args
            pairs = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self._eot,
                                                       max_seq_len=self.max_length, context_len=1)
            for ctx, cont in map(lm_utils.make_disjoint_window, pairs):
                windows.append((None, ctx, cont))
                owner.append(r)
        totals = [0.0] * len(requests)
        for r, (ll, _) in zip(owner, self._loglikelihood_tokens(windows), strict=True):
            totals[r] += ll
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ------------------------------------------------------------------------
    def _gen_options(self, gen_kwargs) -> dict:
        """lm-eval's gen_kwargs -> {until, max_new_tokens, temperature, top_k, top_p}; ValueError
        names any key glm5lab does not implement (allowed: GEN_KWARGS and lm-eval's aliases)."""
        if not isinstance(gen_kwargs, dict):
            raise TypeError(f"gen_kwargs must be a dict, got {type(gen_kwargs).__name__}: {gen_kwargs!r}")
        kw = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        unknown = sorted(set(kw) - set(GEN_KWARGS))
        if unknown:
            raise ValueError(f"generation kwargs {unknown} are not supported by glm5lab: allowed "
                             f"{list(GEN_KWARGS)} (and the max_gen_toks aliases max_new_tokens, max_tokens)")
        do_sample = bool(kw.get("do_sample", False))
        return {"until": handle_stop_sequences(kw.get("until"), eos=None),
                "max_new_tokens": _int_arg("max_gen_toks", kw["max_gen_toks"], 1, self.max_length - 1),
                "temperature": float(kw.get("temperature", 0.0)) if do_sample else 0.0,
                "top_k": kw.get("top_k"), "top_p": kw.get("top_p")}

    def _generate_batch(self, prompts: list[list[int]], opts: dict) -> list[str]:
        """New text per prompt, cut before the first `until` string; a row ends (leaves the batch)
        once its text holds a stop string or it emits `<|endoftext|>`."""
        until = [s for s in opts["until"] if s]

        def holds_stop(_row: int, tokens: list[int]) -> bool:
            return any(s in self.tok_decode(tokens) for s in until)

        rows = generate(self.model, prompts, opts["max_new_tokens"], temperature=opts["temperature"],
                        top_k=opts["top_k"], top_p=opts["top_p"], seed=self.seed, stop_tokens=[self._eot],
                        stop_when=holds_stop if until else None, attn_impl=self.attn_impl).tokens
        texts = []
        for row in rows:
            row = row[:row.index(self._eot)] if self._eot in row else row
            texts.append(postprocess_generated_text(self.tok_decode(row), stop=opts["until"], think_end_token=None))
        return texts

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations for (context, gen_kwargs) requests, batched per distinct gen_kwargs."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())) if isinstance(req.args[1], dict) else "", []).append(i)
        out: list[str | None] = [None] * len(requests)
        for idx in groups.values():
            opts = self._gen_options(requests[idx[0]].args[1])
            max_ctx = self.max_length - opts["max_new_tokens"]
            prompts = {i: self.tok_encode(requests[i].args[0]) or [self._eot] for i in idx}
            for i, ids in prompts.items():
                if len(ids) > max_ctx:
                    log.warning("context of %d tokens left-truncated to max_length - max_gen_toks = %d",
                                len(ids), max_ctx)
                    prompts[i] = ids[-max_ctx:]
            idx = sorted(idx, key=lambda i: -len(prompts[i]))
            for start in range(0, len(idx), self.batch_size):
                chunk = idx[start:start + self.batch_size]
                for i, text in zip(chunk, self._generate_batch([prompts[i] for i in chunk], opts), strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
