"""Data: corpus reading, the document split, tokenizer training and cache, `glm5lab tokenize`, token shards,
batches and the unigram baseline. Imports only the model-independent base (config, validate, io_utils, console).
"""
