"""Training: the data pipeline (`corpus` -> `glm5lab.tokenizer` -> `batches`; see docs/data.md), the
stages, losses and the loop (checkpoints: `glm5lab.checkpoint`).

Import from the submodules, e.g. `from glm5lab.train.sources import iter_documents`.
"""
