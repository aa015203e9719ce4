"""A causal LM as the sentence scorers need it: text -> ids, the start-of-text prefix, ids -> logits.

Two sources on one code path (`glm5lab.evals.sentence_logprob`):
- a glm5lab run, step or HF GLM-5 folder (`glm5lab_lm`): its tokenizer.json adds no special tokens, and training
  streams put `<|endoftext|>` between documents, so a text that starts a document follows `<|endoftext|>`: that id
  is the prefix (as GPT-2's own convention, which lm-evaluation-harness follows for loglikelihoods);
- any transformers causal LM folder (`hf_lm`, AutoModelForCausalLM + AutoTokenizer): the text is encoded without
  special tokens and the prefix is the tokenizer's BOS token, else its EOS token (GPT-2: `<|endoftext|>` both);
  a tokenizer with neither is refused.
Weights are fp32 (near-tied sentences must not flip on rounding), eval mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from glm5lab.evals.sentence_logprob import LogitsFn


@dataclass
class CausalLM:
    """name: what was loaded (a folder); prefix: the id every text is scored after, prefix_token its text;
    max_tokens: the longest sequence (prefix included) the model takes."""

    name: str
    logits_fn: LogitsFn
    encode: Callable[[str], list[int]]
    prefix: int
    prefix_token: str
    max_tokens: int
    device: torch.device


def glm5lab_lm(path, *, device, flag: str = "RUN_OR_CHECKPOINT") -> CausalLM:
    """A glm5lab run folder (its latest checkpoint), a checkpoint folder or an HF GLM-5 folder, with the
    tokenizer.json of the checkpoint (or of `path`). Raises ValueError in one line naming `flag` when `path` is no
    such folder or has no tokenizer."""
    from glm5lab.checkpoints.export import resolve_checkpoint
    from glm5lab.data.tokenizer import TOKENIZER_FILE, load_tokenizer
    from glm5lab.model.model import GLM5ForCausalLM

    folder = resolve_checkpoint(path, flag)
    place = next((p for p in (folder, Path(path)) if (p / TOKENIZER_FILE).is_file()), None)
    if place is None:
        raise ValueError(f"{flag} {path}: no {TOKENIZER_FILE} in {folder} (nor in {path}); BLiMP scores text, so "
                         "the model needs its tokenizer")
    model = GLM5ForCausalLM.from_pretrained(folder, dtype=torch.float32, device=device, mtp=False).eval()
    return model_lm(model, load_tokenizer(place), str(folder))


def model_lm(model, tokenizer, name: str, *, use_dsa: bool | None = None) -> CausalLM:
    """A GLM5ForCausalLM already in memory (on its own device, in the mode the caller set: eval for scoring) and
    its `tokenizers` tokenizer; use_dsa as the model's forward takes it (None: its config's)."""
    from glm5lab.data.tokenizer import EOT, eot_id

    return CausalLM(name, lambda ids, mask: model(ids, use_dsa=use_dsa).logits,
                    lambda text: tokenizer.encode(text).ids, eot_id(tokenizer), EOT,
                    model.config.max_position_embeddings, next(model.parameters()).device)


def hf_lm(folder, *, device, flag: str = "--hf") -> CausalLM:
    """A transformers causal LM folder (config.json, weights, tokenizer). Raises ValueError in one line naming
    `flag` when it is not a folder with a config.json, or its tokenizer has neither a BOS nor an EOS token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = check_hf_folder(folder, flag)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if prefix is None:
        raise ValueError(f"{flag} {folder}: its tokenizer has neither a BOS nor an EOS token, so the first word of a "
                         "sentence cannot be scored given a start of text")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    cfg = model.config
    max_tokens = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 10**9
    return CausalLM(str(folder), lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits,
                    lambda text: tokenizer(text, add_special_tokens=False)["input_ids"], prefix,
                    tokenizer.convert_ids_to_tokens(prefix), max_tokens, torch.device(device))


def check_hf_folder(folder, flag: str = "--hf") -> Path:
    """`folder` as a Path when it holds a config.json; ValueError in one line naming `flag` otherwise."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{flag} {folder} is not allowed: a transformers model folder (config.json, weights, "
                         f"tokenizer files); {'it has no config.json' if folder.is_dir() else 'it is not a folder'}")
    return folder
