"""Training: the data pipeline (`corpus` -> `tokenizer` -> `batches`); see docs/data.md.

Import from the submodules, e.g. `from glm5lab.train.corpus import load_documents`.
"""
