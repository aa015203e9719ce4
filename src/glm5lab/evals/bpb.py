"""Bits per byte: a validation loss that does not depend on the tokenizer.

A loss in nats per token depends on how much text a token covers; dividing the summed loss by
the UTF-8 bytes the scored target tokens stand for, in bits, gives a figure comparable with any
other model's on the same text (the convention of GPT-2/The Pile/nanoGPT reports):

    bpb = sum_t nll_t / (ln 2 * sum_t bytes(target_t))

For a byte-level BPE (`glm5lab.data.tokenizer`: GPT-2's ByteLevel alphabet, one printable character
per byte) the bytes of an id are the length of its token string (an added, non-special token's
are those of its plain-text content); special tokens (the document separator `<|endoftext|>`)
and ids outside the tokenizer (the ablation workbench's task ids) stand for 0 bytes. Their loss
still counts, so a figure that includes separator targets is an upper bound of the pure-text one.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def token_byte_lengths(tokenizer, vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size]: UTF-8 bytes each id stands for under a byte-level BPE `tokenizer`
    (`tokenizers.Tokenizer`): the length of its token string (one ByteLevel character per byte); for an added
    token that is not special, the UTF-8 length of its content (added tokens are stored as plain text); 0 for
    special tokens and ids the tokenizer does not have. Raises ValueError when vocab_size is below the
    tokenizer's own size (ids would be missing), or when the tokenizer is not byte-level (its decoder is not
    `decoders.ByteLevel`, or a vocabulary token holds a character outside GPT-2's ByteLevel alphabet): its
    token lengths would not be byte counts."""
    from tokenizers import decoders, pre_tokenizers

    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        raise ValueError(f"the tokenizer's decoder is {type(tokenizer.decoder).__name__}, not ByteLevel: bits per "
                         "byte needs a byte-level BPE tokenizer (its token strings are one character per byte)")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab_size < size:
        raise ValueError(f"vocab_size = {vocab_size} is below the tokenizer's {size} ids")
    added = tokenizer.get_added_tokens_decoder()
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    out = np.zeros(vocab_size, dtype=np.int64)
    for i in range(size):
        token = tokenizer.id_to_token(i)
        if token is None or (i in added and added[i].special):
            continue
        if i in added:
            out[i] = len(added[i].content.encode("utf-8"))
        elif set(token) <= alphabet:
            out[i] = len(token)
        else:
            raise ValueError(f"token {i} {token!r} is not in GPT-2's ByteLevel alphabet: bits per byte needs a "
                             "byte-level BPE tokenizer")
    return torch.from_numpy(out)


def bits_per_byte(nll_nats_sum: float, utf8_bytes: int) -> float:
    """Summed negative log-likelihood (nats, over the scored targets) / (ln 2 x the UTF-8 bytes those targets
    stand for): bits per byte. Raises ValueError for a non-finite or negative nll or a byte count < 1."""
    if not math.isfinite(nll_nats_sum) or nll_nats_sum < 0:
        raise ValueError(f"nll_nats_sum = {nll_nats_sum} is not allowed: a finite sum >= 0 (nats)")
    if utf8_bytes < 1:
        raise ValueError(f"utf8_bytes = {utf8_bytes} is not allowed: at least 1 byte of scored text")
    return nll_nats_sum / (math.log(2) * utf8_bytes)


def target_bytes(byte_lengths: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> int:
    """Bytes the scored targets stand for: sum of byte_lengths[labels] over labels != ignore_index
    (any shape, int64). Raises ValueError for a label outside [0, len(byte_lengths))."""
    scored = labels[labels != ignore_index]
    if scored.numel() and (int(scored.min()) < 0 or int(scored.max()) >= len(byte_lengths)):
        raise ValueError(f"labels outside [0, {len(byte_lengths)}) (and != {ignore_index})")
    return int(byte_lengths.to(scored.device)[scored].sum())
