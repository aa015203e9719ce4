"""Inference: sampling, the speculative accept rule, and `generate` (cached, plain or MTP-speculative)."""
