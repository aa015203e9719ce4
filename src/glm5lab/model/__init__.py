"""Model code: one concept per file (norm, rope, attention kernels, mla, gqa, dsa, moe, mlp,
mtp, block, model)."""
