"""Inference: sampling, the speculative accept rule, and `generate` (cached, plain or MTP-speculative)."""

DEFAULT_PREFILL_CHUNK = 256
"""Prefill chunk (tokens) of `generate`: on a 2-core CPU, 256 was fastest and smallest among
256..2048 and the whole prompt for the benchmark model at T = 2K..8K (BENCHMARKS.md, prefill).
Defined here, without torch, so the CLI can show it in --help before loading torch."""
