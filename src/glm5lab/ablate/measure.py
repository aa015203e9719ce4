"""What studies score: held-out loss, MQAR accuracy, NIAH exact match, by teacher forcing.

NIAH is scored without generation: the prompt plus its canonical completion goes through one forward, and an
example counts as retrieved when the argmax at every completion position is the expected id. That is exactly
"greedy decoding reproduces the completion", so it equals `score_niah(..., rule="all")` on greedy `generate`
output cut at the completion length, and it also works for mixers without a decode cache (Gated DeltaNet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5lab.ablate.workbench import Workbench
from glm5lab.evals.bpb import bits_per_byte, target_bytes
from glm5lab.evals.mqar import IGNORE_INDEX
from glm5lab.evals.niah import make_niah_batch, training_pair


@torch.no_grad()
def labelled_loss(model, ids_BT: torch.Tensor, labels_BT: torch.Tensor, *, use_dsa: bool | None = None,
                  batch: int = 8) -> float:
    """Mean CE in nats over the labels != -100 of (ids [N, T], labels [N, T]), fp32, in batches."""
    total, count = labelled_nll(model, ids_BT, labels_BT, use_dsa=use_dsa, batch=batch)
    return total / count


@torch.no_grad()
def labelled_nll(model, ids_BT: torch.Tensor, labels_BT: torch.Tensor, *, use_dsa: bool | None = None,
                 batch: int = 8) -> tuple[float, int]:
    """(summed CE in nats, number of scored labels) over the labels != -100 of (ids [N, T], labels [N, T]), fp32,
    in batches: what `labelled_loss` divides, and what bits per byte (`glm5lab.evals.bpb.bits_per_byte`) needs."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for i in range(0, len(ids_BT), batch):
        logits = model(ids_BT[i:i + batch].to(device), use_dsa=use_dsa).logits.float()
        labels = labels_BT[i:i + batch].to(device)
        total += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
        count += int((labels != IGNORE_INDEX).sum())
    return total, count


def text_score(model, val_BT: torch.Tensor, byte_lengths: torch.Tensor, *, use_dsa: bool) -> dict:
    """Validation loss (nats/token), bits per byte and their parts over windows val_BT [N, L + 1]."""
    labels = val_BT[:, 1:]
    nll, tokens = labelled_nll(model, val_BT[:, :-1], labels, use_dsa=use_dsa)
    nbytes = target_bytes(byte_lengths, labels)
    return {"val_loss": nll / tokens, "val_bpb": bits_per_byte(nll, nbytes), "val_nll_sum": nll,
            "val_tokens": tokens, "val_bytes": nbytes}


@torch.no_grad()
def answer_accuracy(model, ids_BT: torch.Tensor, labels_BT: torch.Tensor, *, use_dsa: bool | None = None,
                    batch: int = 8, per_row: bool = False) -> float:
    """Fraction of labelled positions (labels != -100) whose argmax is the label; with per_row,
    the fraction of rows whose every labelled position is right (exact match)."""
    hits = []
    device = next(model.parameters()).device
    for i in range(0, len(ids_BT), batch):
        pred = model(ids_BT[i:i + batch].to(device), use_dsa=use_dsa).logits.argmax(-1)
        labels = labels_BT[i:i + batch].to(device)
        mask = labels != IGNORE_INDEX
        right = (pred == labels) | ~mask
        hits.append(right.all(1).float() if per_row else (pred == labels)[mask].float())
    return float(torch.cat(hits).mean())


def mqar_accuracy(model, bench: Workbench, n: int, seq_len: int, num_kv_pairs: int, *, seed: int,
                  use_dsa: bool | None = None, batch: int = 8) -> float:
    """MQAR per-query accuracy on n fresh rows (seeded) of length seq_len."""
    ids, labels = bench.mqar(n, seq_len, num_kv_pairs, seed=seed)
    return answer_accuracy(model, ids, labels, use_dsa=use_dsa, batch=batch)


def val_prompts(bench: Workbench, s: dict) -> list[list[int]]:
    """The first s["prompt_len"] tokens of the first s["prompts"] validation windows of s["prompt_len"] +
    s["max_new"] tokens: the held-out prompts `mtp_acceptance` decodes from."""
    w = bench.text_windows("val", s["prompt_len"] + s["max_new"])[:s["prompts"]]
    return w[:, :s["prompt_len"]].tolist()


def mtp_acceptance(model, prompts: list[list[int]], max_new: int, draft_steps: int, *, temperature: float = 0.0,
                   seed: int | None = None) -> float:
    """Mean acceptance length (tokens per verification forward = 1 + accepted drafts) of `glm5lab.generate` with
    MTP speculative decoding, `draft_steps` drafts per round, `max_new` new tokens after each prompt (greedy at
    temperature 0, else sampled with `seed`)."""
    from glm5lab import generate

    out = generate(model, prompts, max_new, temperature=temperature, seed=seed, speculative="mtp",
                   draft_steps=draft_steps)
    return float(out.stats.acceptance_length)


def niah_accuracy(model, bench: Workbench, n: int, context_length: int, *, seed: int, use_dsa: bool | None = None,
                  batch: int = 4) -> float:
    """NIAH exact match (every expected value, teacher forced; see the module docstring) on n single-needle
    examples of `context_length` prompt tokens in a noise haystack (filler ids)."""
    examples = make_niah_batch(bench.tasks, n, context_length, "single", seed=seed)
    return niah_exact_match(model, examples, use_dsa=use_dsa, batch=batch)


def niah_exact_match(model, examples, *, use_dsa: bool | None = None, batch: int = 4) -> float:
    """Fraction of `NIAHExample`s (one prompt length) whose canonical completion is the argmax at
    every completion position given prompt + true earlier tokens (= greedy generation reproduces
    it; see the module docstring). Raises ValueError if the examples' lengths differ."""
    pairs = [training_pair(e) for e in examples]
    if len({len(p[0]) for p in pairs}) != 1:
        raise ValueError("examples must share one prompt + completion length to be batched")
    ids = torch.stack([p[0] for p in pairs])
    labels = torch.stack([p[1] for p in pairs])
    return answer_accuracy(model, ids, labels, use_dsa=use_dsa, batch=batch, per_row=True)
