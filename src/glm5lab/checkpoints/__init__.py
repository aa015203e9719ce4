"""Checkpoints: saving, loading and resuming a run's state at any process count and `--ep`, resharding, and
`glm5lab export` to the HF folder. Imports model, hf, data (the tokenizer files) and parallel; never train.
"""
