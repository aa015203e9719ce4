"""A held-out set the user names (`glm5lab train --val-data PATH`, `glm5lab eval perplexity RUN PATH`): its tokens
under a run's tokenizer, scored instead of the document split of the training corpus.

PATH is what `glm5lab train --data` reads (`glm5lab.data.sources`: a .txt/.md, .jsonl or .parquet/.arrow file, or a
folder of them), scored whole (no split: `glm5lab.data.tokenize.cached_held_out_folder`, tokenized once into the
cache), or a token folder (`glm5lab tokenize`): its validation split, the one `--data FOLDER` validates on, written
with the same tokenizer. Either way the set is a `ShardedTokens`, read on demand, so validation (`glm5lab.train.
evaluation.evaluate_nll`) scores it exactly as it scores the default split: the same windows on every rank.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from glm5lab.data.shards import ShardedTokens, is_token_folder, open_token_folder, tokenizer_sha256
from glm5lab.validate import refuse

FORMATS = ("a .txt/.md file, a .jsonl file (`text` field), a .parquet/.arrow file, a folder of such files, or a token "
           "folder")


@dataclass
class HeldOutSet:
    """tokens: the set's ids under the run's tokenizer. record: what summary.json and perplexity.json say was scored
    (`path` as given, `kind` "text" or "token folder", `documents`, `tokens`, the token `folder` read)."""

    tokens: ShardedTokens
    record: dict


def _stderr(message: str) -> None:
    print(f"glm5lab: {message}", file=sys.stderr, flush=True)


def check_exists(path, name: str = "--val-data") -> None:
    """Refuse (ValueError, one line naming `name`) a `path` that does not exist: before a run writes anything."""
    if not Path(path).exists():
        refuse(name, str(path), f"no such file or folder; give {FORMATS}")


def check_not_training_text(path, data) -> None:
    """Refuse (ValueError, one line naming --val-data) a text `path` that is the text corpus `data` (--data) or lies
    inside it: scored whole, it would hold the training documents. A token folder is allowed (its validation split
    is held out); `data` None (the default corpus) passes."""
    if data is None or is_token_folder(path):
        return
    val, train = Path(path).resolve(), Path(data).resolve()
    if val == train or train in val.parents:
        refuse("--val-data", str(path), f"a held-out set, not the training text (--data {data}): scored whole it "
               "would hold the training documents; give other text, or leave --val-data out to validate on --data's "
               "held-out document split")


def held_out_set(path, tokenizer, *, name: str = "--val-data", say: Callable[[str], None] = _stderr) -> HeldOutSet:
    """The held-out set at `path` under `tokenizer` (a `tokenizers.Tokenizer`: the run's). A token folder gives its
    validation split; anything else is tokenized whole into the cache (a fill said through `say`). Raises
    ValueError in one line naming `name` and `path`: a missing path, a token folder written with another tokenizer
    (both sha256 named), a set of 0 tokens, and `open_corpus`'s refusals (an empty file or folder, bad UTF-8, ...)
    after them."""
    check_exists(path, name)
    if is_token_folder(path):
        folder = open_token_folder(path)
        have, want = folder.index["tokenizer_sha256"], tokenizer_sha256(tokenizer)
        if have != want:
            refuse(name, str(path), f"a token folder written with another tokenizer (sha256 {have[:12]}) than the "
                   f"run's ({want[:12]}): tokenize the text with `glm5lab tokenize --tokenizer RUN/model`, or give "
                   "the text itself")
        tokens, kind, where = folder.val, "token folder", folder.path
        documents = folder.index["splits"]["val"]["documents"]
    else:
        from glm5lab.data.tokenize import cached_held_out_folder

        try:
            where = cached_held_out_folder(path, tokenizer, say=say, flag=name)
        except ValueError as e:  # the reader's own line (an empty file or folder, bad UTF-8, ...), named
            raise ValueError(f"{name} {path}: {e}") from None
        folder = open_token_folder(where)
        tokens, kind, documents = folder.val, "text", folder.index["splits"]["val"]["documents"]
    if len(tokens) == 0:
        refuse(name, str(path), "an empty set: it holds 0 tokens" + (" in its validation split" if kind != "text"
                                                                      else ""))
    record = {"path": str(path), "kind": kind, "documents": documents, "tokens": len(tokens), "folder": str(where)}
    return HeldOutSet(tokens, record)


def check_window(held: HeldOutSet, seq_len: int, name: str = "--val-data") -> None:
    """Refuse (ValueError, one line) a set shorter than one validation window of seq_len + 1 tokens."""
    if len(held.tokens) < seq_len + 1:
        refuse(name, held.record["path"], f"it holds {len(held.tokens):,} tokens under the run's tokenizer, fewer than "
               f"one validation window of seq_len {seq_len} + 1 = {seq_len + 1:,} tokens: give more text, or a "
               "smaller --seq-len")
