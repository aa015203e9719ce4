"""The report's figures each study is printed beside (from ../shared/SPEC.md, "Report figures a
reproduction is compared with"; source: the GLM-5 technical report's ablation tables). They are
compared by shape (ordering, sign of a change), not by absolute value: the report's models are
billions of parameters trained on billions of tokens, ours are trained for minutes on a CPU.
"""

from __future__ import annotations

MLA_BENCHMARKS = ("HellaSwag", "MMLU", "C-Eval", "RACE", "BBH", "GSM8K", "HumanEval")
MLA = {  # proxy ablation, accuracy %
    "GQA-8": (77.3, 61.2, 60.0, 79.6, 53.3, 47.6, 38.5),
    "MLA": (77.3, 61.5, 59.7, 77.8, 48.9, 46.2, 33.5),
    "MLA + Muon Split": (77.8, 62.5, 62.1, 79.9, 51.8, 45.0, 36.7),
    "MLA-256 + Muon Split": (77.4, 62.0, 59.9, 79.6, 51.3, 47.5, 36.6),
}

CONTEXTS = ("4K", "8K", "16K", "32K", "64K", "128K")
DSA = {  # GLM-4.7-Flash, long-context retrieval score by context length
    "dense": (97.44, 96.72, 95.83, 92.96, 85.34, 79.21),
    "warm-up only": (97.51, 96.54, 95.40, 90.09, 84.05, 71.35),
    "full adaptation": (96.77, 96.25, 96.69, 93.45, 87.06, 78.86),
}
DSA_128K = {"benchmarks": ("MQ-NIAH", "MV-NIAH", "SQuAD", "HotpotQA"),
            "MLA": (100.0, 95.5, 79.7, 66.3), "DSA": (100.0, 97.0, 86.0, 63.0)}

SWA = {  # no extra training, score by context length
    "full": (95.19, 93.67, 92.01, 91.09, 85.35, 75.28),
    "1:1 SWA": (94.87, 54.02, 25.89, 12.61, 8.32, 6.51),
    "searched SWA": (95.78, 92.54, 88.92, 82.52, 70.23, 53.95),
}

EFFICIENT_BENCHMARKS = ("RULER", "MRCR", "HELMET", "RepoQA")
EFFICIENT = {  # after 190B tokens at 64K: change vs full attention at 128K
    "SWA interleave": (-30.35, -6.56, -13.84, -26.50),
    "searched SWA": (-5.69, -1.81, -2.76, -14.66),
    "Gated DeltaNet": (-11.28, -5.17, -2.52, -9.66),
    "SimpleGDN": (-8.25, -4.12, +4.48, -7.33),
}

MTP = {"GLM-5": 2.76, "DeepSeek-V3.2": 2.55, "draft_steps": 4}  # mean acceptance length, private prompts

DSA_ATTENTION_SPEEDUP = (1.5, 2.0)  # authors' measurement of long-sequence attention compute cut
INDEXCACHE = {
    "source": "IndexCache (Bai et al. 2026, arXiv 2603.12201), a 30B DSA model with 1/2 of its indexers kept in a "
              "uniform interleave; long-context average / general and reasoning average",
    "full DSA": (51.0, 74.2),
    "training-aware": (51.6, 74.5),  # multi-layer distillation
    "no cross-layer loss": (49.8, None),  # the same pattern trained with each indexer's own loss; long only
}
"""The IndexCache paper's training-aware figures (not in the GLM-5 report, which gives none): (long-context
average, general and reasoning average), None where the paper gives no figure."""


def mean(values) -> float:
    """Arithmetic mean of a sequence of figures."""
    return sum(values) / len(values)
