"""Measurements a report makes on a run's latest checkpoint: prefill and decode throughput (with
their batch and length), retrieval accuracy by context length, and MTP acceptance by draft
position, at a short prompt and against context length. All greedy (deterministic); fp32 on CPU, the
checkpoint's dtype elsewhere.

Acceptance against context: the same speculative decoding after held-out prompts of each length in
`acceptance_contexts`. It measures the drafts against the main model's own greedy continuation, which is not
held-out text: past the length a run trained at, a small model's greedy continuation falls into repeated
phrases, where the chained drafts (positions 2 and up) rarely all hold, so the later positions' curves fall
first (docs/inference.md, "Where drafts are rejected").

Retrieval: single-needle NIAH (`glm5lab.evals.make_niah`) with a haystack of held-out corpus tokens, scored by
teacher-forced exact match (`glm5lab.ablate.measure`: equal to greedy generation reproducing the answer). The
needle's key and value ids are ordinary vocabulary ids (the top of the vocabulary); a model trained on text
alone was never asked to retrieve, so expect about 0: `glm5lab ablate` trains on retrieval data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ProbeSizes:
    """throughput: (batch, prompt length) pairs, each prefilled then decoding `decode_tokens`.
    retrieval_lengths: NIAH context lengths, `retrieval_rows` examples each. acceptance: MTP
    speculative decoding with `draft_steps` drafts on `acceptance_rows` held-out prompts of
    `acceptance_prompt` tokens, `acceptance_tokens` new tokens each, and the same after prompts of each
    length in `acceptance_contexts` (tokens)."""

    throughput: tuple[tuple[int, int], ...] = ((1, 256), (1, 1024), (4, 256))
    decode_tokens: int = 32
    retrieval_lengths: tuple[int, ...] = (64, 128, 256, 512, 1024)
    retrieval_rows: int = 16
    draft_steps: int = 3
    acceptance_rows: int = 8
    acceptance_prompt: int = 64
    acceptance_tokens: int = 48
    acceptance_contexts: tuple[int, ...] = (256, 512, 1024, 2048)

    @classmethod
    def quick(cls) -> "ProbeSizes":
        """Tiny sizes for tests (seconds; the numbers mean nothing)."""
        return cls(throughput=((1, 32), (2, 32)), decode_tokens=4, retrieval_lengths=(32, 64), retrieval_rows=2,
                   acceptance_rows=2, acceptance_prompt=16, acceptance_tokens=8, acceptance_contexts=(16, 32))


def probe(checkpoint, val_tokens: np.ndarray, sizes: ProbeSizes) -> dict:
    """Load the checkpoint and measure (see the module docstring). val_tokens: held-out ids (1-D).
    Returns {"sizes", "throughput": [...], "retrieval": [...], "acceptance": {...} or None,
    "acceptance_by_context": [{...} per length in `acceptance_contexts`] (empty without an MTP layer)}; a
    measurement that does not fit (longer than the model's max_position_embeddings or the
    held-out text) is listed with "skipped" and the reason."""
    from glm5lab import GLM5ForCausalLM

    model = GLM5ForCausalLM.from_pretrained(checkpoint).eval()
    val = torch.as_tensor(np.asarray(val_tokens, dtype=np.int64))
    with torch.no_grad():
        return {"sizes": asdict(sizes), "throughput": [_throughput(model, val, b, n, sizes.decode_tokens)
                                                       for b, n in sizes.throughput],
                "retrieval": [_retrieval(model, val, n, sizes.retrieval_rows) for n in sizes.retrieval_lengths],
                "acceptance": _acceptance(model, val, sizes, sizes.acceptance_prompt),
                "acceptance_by_context": [] if not model.config.num_nextn_predict_layers else
                [{"context_length": n, **_acceptance(model, val, sizes, n)} for n in sizes.acceptance_contexts]}


def _fits(model, val: torch.Tensor, rows: int, length: int) -> str | None:
    limit = model.config.max_position_embeddings
    if length > limit:
        return f"longer than max_position_embeddings = {limit}"
    if rows * length > len(val):
        return f"needs {rows * length} held-out tokens, the run has {len(val)}"
    return None


def _prompts(val: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    return val[: rows * length].view(rows, length)


def _throughput(model, val, batch: int, length: int, new: int) -> dict:
    from glm5lab import generate

    row = {"batch": batch, "prompt_length": length, "new_tokens": new}
    why = _fits(model, val, batch, length + new)
    if why:
        return {**row, "skipped": why}
    generate(model, _prompts(val, batch, length)[:, :8], 2)  # warm-up (allocator, first-call costs)
    stats = generate(model, _prompts(val, batch, length), new).stats
    return {**row, "prefill_tokens_per_second": batch * length / stats.prefill_seconds,
            "prefill_seconds": stats.prefill_seconds, "decode_tokens_per_second": stats.decode_tokens_per_second}


def _retrieval(model, val, length: int, rows: int) -> dict:
    from glm5lab.ablate.measure import niah_exact_match
    from glm5lab.evals.niah import make_niah_batch
    from glm5lab.evals.tasks import TaskVocab

    row = {"context_length": length, "rows": rows}
    why = _fits(model, val, 1, length + 8)
    if why:
        return {**row, "skipped": why}
    V = model.config.vocab_size
    vocab = TaskVocab.from_range(V, V - 5 - 2 * 16, 16, 16)
    try:
        examples = make_niah_batch(vocab, rows, length, seed=0, haystack=val.numpy())
    except ValueError as e:
        return {**row, "skipped": str(e)}
    return {**row, "accuracy": niah_exact_match(model, examples)}


def _acceptance(model, val, sizes: ProbeSizes, length: int) -> dict | None:
    """Greedy MTP speculative decoding after `acceptance_rows` held-out prompts of `length` tokens, spread over
    the held-out text (None without an MTP layer; {"skipped": why} when it does not fit)."""
    from glm5lab import generate

    if not model.config.num_nextn_predict_layers:
        return None
    n = sizes.acceptance_rows
    why = _fits(model, val, n, length + sizes.acceptance_tokens + sizes.draft_steps + 1)
    if why:
        return {"skipped": why}
    stride = len(val) // n  # prompts from across the held-out text
    prompts = torch.stack([val[i * stride:i * stride + length] for i in range(n)])
    stats = generate(model, prompts, sizes.acceptance_tokens, speculative="mtp", draft_steps=sizes.draft_steps).stats
    return {"draft_steps": sizes.draft_steps, "rows": n, "prompt_length": length,
            "new_tokens": sizes.acceptance_tokens, "acceptance_length": stats.acceptance_length,
            "acceptance_rate": stats.acceptance_rate, "verify_steps": stats.verify_steps}
