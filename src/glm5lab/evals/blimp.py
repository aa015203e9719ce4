"""BLiMP, the Benchmark of Linguistic Minimal Pairs (Warstadt et al., TACL 2020): data, scoring, summary.

The paper's "simple LM method": a pair is right when the model gives the whole good sentence a higher total
log-probability than the whole bad one (`glm5lab.evals.sentence_logprob`; every token scored, the first given the
model's start-of-text prefix). A tie is wrong (the rule is a strict good > bad; a tie can only come from equal
token sequences or exact float equality, and the count is reported as `ties`). Accuracy per paradigm (67 x 1,000
pairs), per phenomenon (the paper's 12 groups: each paradigm's `linguistics_term` in models_summary.jsonl, where
the paper files the two s-selection paradigms under argument_structure) as the mean over its paradigms, and
overall as the mean over paradigms, as the paper reports them.

Interval: the 95% normal approximation of a mean over K paradigms each of n_k independent pairs:
accuracy +- 1.96 * sqrt(sum_k p_k (1 - p_k) / n_k) / K (the sampling spread of the pairs; the choice of paradigms
is fixed by the benchmark). The same for each group over its paradigms.

Data: a copy ships in the package (`DATA_DIR`, CC BY 4.0; README.md there gives the source and credit); any folder
with the same two files can replace it (`--data DIR`).
"""

from __future__ import annotations

import gzip
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).with_name("blimp_data")
PAIRS_FILE, PUBLISHED_FILE = "blimp.jsonl.gz", "models_summary.jsonl"
PUBLISHED = {"ngram": "5-gram", "lstm": "LSTM", "txl": "Transformer-XL", "gpt2": "GPT-2"}
"""The published models (keys of models_summary.jsonl) and their names in the paper's Table 3."""
Z95 = 1.959963984540054
CITATION = "Warstadt et al., BLiMP: The Benchmark of Linguistic Minimal Pairs for English, TACL 2020 (CC BY 4.0)"


@dataclass(frozen=True)
class Pair:
    """One minimal pair: its paradigm (UID), phenomenon group, and the two sentences."""

    uid: str
    group: str
    good: str
    bad: str


def check_data_dir(data_dir, flag: str = "--data") -> Path:
    """The folder holding blimp.jsonl.gz and models_summary.jsonl; ValueError in one line otherwise."""
    folder = Path(data_dir)
    missing = [f for f in (PAIRS_FILE, PUBLISHED_FILE) if not (folder / f).is_file()]
    if not folder.is_dir() or missing:
        why = "it is not a folder" if not folder.is_dir() else f"it lacks {', '.join(missing)}"
        raise ValueError(f"{flag} {data_dir} is not allowed: a folder with {PAIRS_FILE} and {PUBLISHED_FILE} "
                         f"(the BLiMP copy's layout, e.g. {DATA_DIR}); {why}")
    return folder


def load_published(data_dir=DATA_DIR) -> dict[str, dict]:
    """Paradigm UID -> {"group": the paper's phenomenon, "ngram"/"lstm"/"txl"/"gpt2": accuracy in [0, 1]}
    (the file's per-group and overall rows, UID "overall", are left out: they are recomputed from these). Raises
    ValueError naming the file and line for a row that is not JSON or lacks a field."""
    file, published = Path(data_dir) / PUBLISHED_FILE, {}
    for n, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            row = {"group": r["linguistics_term"], **{k: r[k] for k in PUBLISHED}}
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{file} line {n}: not a BLiMP models_summary row ({type(e).__name__}: {e})") from None
        if r["UID"] != "overall":
            published[r["UID"]] = row
    return published


def load_pairs(data_dir=DATA_DIR, limit: int | None = None) -> list[Pair]:
    """The pairs in file order, grouped as the paper does (`load_published`'s group, else the line's own
    linguistics_term); with `limit`, the first `limit` pairs of each paradigm (a subset: every paradigm kept).
    Raises ValueError for a limit < 1 or above the smallest paradigm's pairs, a malformed line (naming the file
    and line), a file that is not gzip-compressed UTF-8 or holds no pairs."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit {limit} is not allowed: at least 1 pair per paradigm")
    published, file = load_published(data_dir), Path(data_dir) / PAIRS_FILE
    pairs, seen = [], defaultdict(int)
    try:
        with gzip.open(file, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                try:
                    d = json.loads(line)
                    uid, good, bad, term = d["UID"], d["sentence_good"], d["sentence_bad"], d["linguistics_term"]
                except (ValueError, KeyError) as e:
                    raise ValueError(f"{file} line {n}: not a BLiMP pair ({type(e).__name__}: {e})") from None
                if limit is None or seen[uid] < limit:
                    seen[uid] += 1
                    pairs.append(Pair(uid, published.get(uid, {}).get("group", term), good, bad))
    except (gzip.BadGzipFile, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not a gzip-compressed UTF-8 JSONL file ({e})") from None
    if not pairs:
        raise ValueError(f"{file} holds no BLiMP pairs: give the folder of a BLiMP copy")
    if limit is not None and limit > min(seen.values()):
        raise ValueError(f"--limit {limit} is not allowed: at most {min(seen.values())} (the pairs of the smallest "
                         "paradigm); leave it out to score them all")
    return pairs


def mean_with_interval(accuracies: list[float], counts: list[int]) -> tuple[float, float, float]:
    """(mean, low, high): the mean of per-paradigm accuracies p_k over n_k pairs each and its 95% normal interval,
    mean +- Z95 * sqrt(sum p_k (1 - p_k) / n_k) / K."""
    k = len(accuracies)
    mean = sum(accuracies) / k
    half = Z95 * math.sqrt(sum(p * (1 - p) / n for p, n in zip(accuracies, counts))) / k
    return mean, mean - half, mean + half


def summarize(pairs: list[Pair], good_lp: list[float], bad_lp: list[float], published: dict[str, dict]) -> dict:
    """The result dict (written as blimp.json): per paradigm, per group and overall accuracy with the 95%
    interval, and the published models' figures over the same paradigms (None where a paradigm has none)."""
    right, count, group_of = defaultdict(int), defaultdict(int), {}
    ties = 0
    for p, g, b in zip(pairs, good_lp, bad_lp, strict=True):
        right[p.uid] += g > b
        ties += g == b
        count[p.uid] += 1
        group_of[p.uid] = p.group
    paradigms = {u: {"group": group_of[u], "accuracy": right[u] / count[u], "pairs": count[u],
                     "published": {k: published.get(u, {}).get(k) for k in PUBLISHED}} for u in count}
    groups = {g: _aggregate([u for u in paradigms if group_of[u] == g], paradigms)
              for g in sorted(set(group_of.values()))}
    return {"pairs": len(pairs), "ties": ties, "tie_rule": "wrong (good > bad strictly)",
            "interval": "95% normal approximation over pairs: +-1.96 sqrt(sum p(1-p)/n)/K over the K paradigms",
            "overall": _aggregate(list(paradigms), paradigms), "groups": groups, "paradigms": paradigms}


def _aggregate(uids: list[str], paradigms: dict) -> dict:
    acc, lo, hi = mean_with_interval([paradigms[u]["accuracy"] for u in uids], [paradigms[u]["pairs"] for u in uids])
    pub = {}
    for k in PUBLISHED:
        values = [paradigms[u]["published"][k] for u in uids]
        pub[k] = None if None in values else sum(values) / len(values)
    return {"accuracy": acc, "ci95": [lo, hi], "paradigms": len(uids), "pairs": sum(paradigms[u]["pairs"] for u in uids),
            "published": pub}


def render_table(result: dict) -> str:
    """A markdown table: one row per phenomenon group and the overall row, accuracy in % with the interval, the
    published models beside."""
    head = "| phenomenon | paradigms | this model (95% CI) | " + " | ".join(PUBLISHED.values()) + " |"
    lines = [head, "|" + "---|" * (3 + len(PUBLISHED))]
    rows = [*result["groups"].items(), ("**overall** (mean of paradigms)", result["overall"])]
    for name, r in rows:
        pub = " | ".join("-" if r["published"][k] is None else f"{100 * r['published'][k]:.1f}" for k in PUBLISHED)
        lo, hi = r["ci95"]
        lines.append(f"| {name} | {r['paradigms']} | {100 * r['accuracy']:.1f} ({100 * lo:.1f}-{100 * hi:.1f}) | {pub} |")
    return "\n".join(lines) + "\n"


def score_pairs(lm, pairs: list[Pair], *, batch_size: int = 32, progress: bool = True) -> tuple[list[float], list[float]]:
    """Total log-probabilities (nats) of each pair's good and bad sentence under `lm` (a
    `glm5lab.evals.causal_lm.CausalLM`), each given lm.prefix; a tqdm bar over sentences on stderr with `progress`.
    Raises ValueError when a sentence encodes to no token or is longer than the model takes."""
    from tqdm import tqdm

    from glm5lab.evals.sentence_logprob import sequence_logprobs

    texts = [s for p in pairs for s in (p.good, p.bad)]
    seqs = [[lm.prefix, *lm.encode(t)] for t in texts]
    for t, s in zip(texts, seqs):
        if not 2 <= len(s) <= lm.max_tokens:
            raise ValueError(f"the sentence {t!r} is {len(s) - 1} tokens: scoring needs 1 to {lm.max_tokens - 1}")
    with tqdm(total=len(seqs), desc="blimp", unit="sent", disable=not progress) as bar:
        lps = sequence_logprobs(lm.logits_fn, seqs, batch_size=batch_size, device=lm.device, on_batch=bar.update)
    return lps[0::2], lps[1::2]
