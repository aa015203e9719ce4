"""Perplexity of a causal LM on held-out token ids, with strided sliding windows (the
transformers "Perplexity of fixed-length models" recipe).

Legend: N held-out ids, W window (input tokens per forward), S stride. Targets are ids[1:] (N - 1 tokens;
ids[0] has no context and is never scored). Window k feeds ids[kS : kS + W] (shorter at the end) and scores
only the targets that no earlier window scored, so every target is counted exactly once; with S < W each
scored target (after the first window) sees at least W - S tokens of context. S = W gives disjoint windows.

`run_perplexity` scores a held-out set with a trained run's model the way training's validation does (disjoint
windows of the run's seq_len, `glm5lab.train.evaluation.evaluate_nll`): `glm5lab eval perplexity RUN PATH`, whose
figures equal the summary of a run trained with `--val-data PATH`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glm5lab.data.batches import token_ids
from glm5lab.validate import int_at_least


@dataclass
class PerplexityResult:
    """nll: mean negative log-likelihood in nats/token over `tokens` targets; ppl = exp(nll)."""

    nll: float
    ppl: float
    tokens: int
    windows: int


@torch.no_grad()
def perplexity(model, ids, window: int, stride: int | None = None) -> PerplexityResult:
    """Mean NLL (nats/token) and perplexity of `model` (GLM5ForCausalLM: `model(x).logits` [1, T, V]) on the
    1-D int64 ids (tensor, array or list), windows of `window` tokens moved by `stride` (default window).
    Log-probabilities in fp32, summed in fp64. The model's mode (train/eval) is left as the caller set it.

    Raises ValueError if ids is not 1-D, has ids outside [0, vocab_size), or fewer than 2 tokens;
    window < 2 or > max_position_embeddings; stride not in [1, window].
    """
    cfg = model.config
    x = torch.from_numpy(token_ids("ids", ids, cfg.vocab_size))
    if len(x) < 2:
        raise ValueError(f"ids has {len(x)} tokens: perplexity needs at least 2 (one target)")
    window = int_at_least("window", window, 2)
    if window > cfg.max_position_embeddings:
        raise ValueError(f"window = {window} exceeds max_position_embeddings = {cfg.max_position_embeddings}")
    stride = window if stride is None else int_at_least("stride", stride, 1)
    if stride > window:
        raise ValueError(f"stride = {stride} is not allowed: it must lie in [1, window={window}]")
    device = next(model.parameters()).device
    total, scored, begin, windows = 0.0, 0, 0, 0  # scored = last target index scored so far
    n = len(x)
    while scored < n - 1:
        end = min(begin + window, n - 1)  # inputs x[begin:end], targets x[begin+1:end+1]
        new = end - scored
        inp = x[begin:end].to(device)[None]
        logits = model(inp, logits_to_keep=new).logits[0, -new:].float()
        total += float(F.cross_entropy(logits, x[end - new + 1:end + 1].to(device), reduction="sum").double())
        scored, begin, windows = end, begin + stride, windows + 1
    nll = total / (n - 1)
    return PerplexityResult(nll, math.exp(nll), n - 1, windows)


PERPLEXITY_FILE = "perplexity.json"
"""What `glm5lab eval perplexity` writes into the run folder's evals/ (`glm5lab report` shows RUN/evals/*.json)."""


def run_perplexity(model_path, data, *, seq_len: int | None = None, batch_size: int | None = None,
                   device="cpu", say=None) -> dict:
    """A trained model's loss on the held-out set `data` (`glm5lab.data.heldout`: text, JSONL, parquet, or a token
    folder's validation split), computed as training's validation computes it (`glm5lab.train.evaluation.
    evaluate_nll`: disjoint windows of seq_len + 1 tokens, the tail that fills none dropped, fp32, batches of the
    last stage's batch_size, its DSA switch), so a run trained with `--val-data data` gives its summary's val_loss
    and val_bits_per_byte. `model_path`: a run folder (its latest checkpoint) or a checkpoint folder, with its
    tokenizer.json; the stage is the last of the run's run.json (`seq_len` / `batch_size` override it; a folder
    outside a run needs `seq_len`: batch 1, DSA on when the model has an indexer). Returns a dict: loss (nats/token),
    perplexity, bits_per_byte and bytes (None for a tokenizer that is not byte-level), tokens (targets scored),
    windows, seq_len, batch_size, use_dsa, model, data, val_set (`HeldOutSet.record`), run_dir (None outside a run).
    Raises ValueError in one line: a folder that is not a checkpoint, has no tokenizer.json, or no run.json and no
    seq_len; a missing, empty or too short set (`held_out_set`, `check_window`)."""
    from dataclasses import replace

    from glm5lab.checkpoints.export import resolve_checkpoint
    from glm5lab.data.batches import pack
    from glm5lab.data.heldout import check_window, held_out_set
    from glm5lab.data.pipeline import run_folder_of, run_json_of
    from glm5lab.data.tokenizer import TOKENIZER_FILE, load_tokenizer
    from glm5lab.model.model import GLM5ForCausalLM
    from glm5lab.train.evaluation import evaluate_nll, run_byte_lengths
    from glm5lab.train.stages import Stage
    from glm5lab.validate import refuse

    folder = resolve_checkpoint(model_path, "RUN")
    if not (folder / TOKENIZER_FILE).is_file():
        refuse("RUN", str(model_path), f"a run or checkpoint folder holding {TOKENIZER_FILE} ({folder} has none): "
               "the text is tokenized with the model's own tokenizer")
    run = run_json_of(folder)
    if run is None and seq_len is None:
        refuse("RUN", str(model_path), "a folder of a `glm5lab train` run (run.json names the window and batch of "
               "its validation), or give --seq-len")
    stage = (Stage.from_dict(run["stages"][-1]) if run is not None else
             Stage("eval", 1, 0.0, seq_len, 1, use_dsa=_has_indexer(folder)))
    if seq_len is not None:
        stage = replace(stage, seq_len=int_at_least("--seq-len", seq_len, 1))
        _check_positions(folder, seq_len)
    if batch_size is not None:
        stage = replace(stage, batch_size=int_at_least("--batch-size", batch_size, 1))
    tokenizer = load_tokenizer(folder / TOKENIZER_FILE)
    held = held_out_set(data, tokenizer, name="PATH", say=say or (lambda m: None))
    check_window(held, stage.seq_len, name="PATH")
    model = GLM5ForCausalLM.from_pretrained(folder, dtype=torch.float32, device=device, mtp=False)
    byte_lengths = run_byte_lengths(tokenizer, model.config.vocab_size)
    windows = pack(held.tokens, stage.seq_len)
    result = evaluate_nll(model, windows, stage, None, byte_lengths_V=byte_lengths)
    finite_bytes = result.utf8_bytes if result.utf8_bytes else None
    run_dir = run_folder_of(folder)
    return {"loss": result.loss, "perplexity": math.exp(result.loss) if result.loss < 709.0 else math.inf,
            "bits_per_byte": result.bits_per_byte if finite_bytes else None, "bytes": finite_bytes,
            "tokens": result.tokens, "windows": len(windows), "seq_len": stage.seq_len,
            "batch_size": stage.batch_size, "use_dsa": stage.use_dsa, "model": str(folder), "data": str(data),
            "val_set": held.record, "run_dir": None if run_dir is None else str(run_dir)}


def _check_positions(folder, seq_len: int) -> None:
    """Refuse (ValueError naming --seq-len) a window longer than the model's max_position_embeddings, before the
    text is tokenized or the weights loaded."""
    from glm5lab.config import ModelConfig
    from glm5lab.validate import refuse

    most = ModelConfig.from_hf(folder).max_position_embeddings
    if seq_len > most:
        refuse("--seq-len", seq_len, f"1..{most} (the model's max_position_embeddings)")


def _has_indexer(folder) -> bool:
    from glm5lab.config import ModelConfig

    return ModelConfig.from_hf(folder).has_indexer_weights
