"""The data every study trains and scores on: Shakespeare text plus the synthetic tasks.

One vocabulary of `vocab_size` ids: a byte-level BPE trained on the corpus's training split at
`vocab_size - reserved` ids takes [0, text_vocab), and the task markers, keys and values of a
`TaskVocab` take the top `reserved` ids, so text and retrieval rows can share a batch. Filler
ids (MQAR gaps, noise haystacks) are the text ids.

Legend: B batch rows, T input length. A batch is (input_ids_BT, labels_BT), int64, labels
already shifted (-100 = ignored): text rows are next-token targets, task rows score answers only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from glm5lab.evals.mqar import make_mqar_batch
from glm5lab.evals.tasks import MARKERS, TaskVocab, derive_seed
from glm5lab.data.batches import BatchStream, pack
from glm5lab.train.stages import Stage
from glm5lab.validate import one_of

Batch = tuple[torch.Tensor, torch.Tensor]
BatchFn = Callable[[int, Stage, int], Batch]
"""(stage index, stage, step within the stage) -> a batch; a pure function, so runs are seeded."""
SPLIT_SEED = 0
"""The document split of every study's corpus (`data.pipeline.prepare_data`): `glm5lab train`'s
default --seed, so the studies hold out what a default run holds out."""


@dataclass
class Workbench:
    """Tokenized corpus splits and the task vocabulary (see the module docstring)."""

    vocab_size: int
    tokenizer: Tokenizer
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    tasks: TaskVocab

    @classmethod
    def load(cls, vocab_size: int = 512, num_keys: int = 32, num_values: int = 32, *,
             data: str | None = None) -> "Workbench":
        """Tokenize `data` (a text corpus as `glm5lab train --data` reads it: a .txt/.md/.jsonl/.parquet/.arrow
        file or a folder of them; default: the Shakespeare corpus, fetched on first use), split by document and
        tokenized as `glm5lab train` does (`prepare_data` at the text ids, split seed SPLIT_SEED). Raises
        ValueError when the reserved ids leave fewer than 300 ids for text (a byte-level BPE) or `data` is a token
        folder (its ids are another tokenizer's), FileNotFoundError for a missing `data`."""
        from glm5lab.data.pipeline import prepare_data
        from glm5lab.data.shards import is_token_folder

        if data is not None and is_token_folder(data):
            raise ValueError(f"--data {data} is a token folder (glm5lab tokenize): a study trains its own tokenizer "
                             "at its vocabulary with task ids reserved, so it reads text; pass the text corpus the "
                             "folder was made from")

        reserved = len(MARKERS) + num_keys + num_values
        text_vocab = vocab_size - reserved
        if text_vocab < 300:
            raise ValueError(f"vocab_size = {vocab_size} leaves {text_vocab} text ids after {reserved} task ids: "
                             "at least 300 needed (a byte-level BPE)")
        text = prepare_data(text_vocab, data, SPLIT_SEED)
        tasks = TaskVocab.from_range(vocab_size, text_vocab, num_keys, num_values, filler=range(text_vocab))
        return cls(vocab_size, text.tokenizer, np.asarray(text.train_tokens, dtype=np.int64),
                   np.asarray(text.val_tokens, dtype=np.int64), tasks)

    def text_windows(self, split: str, seq_len: int) -> torch.Tensor:
        """int64 [N, seq_len + 1] non-overlapping windows of the "train" or "val" split."""
        one_of("split", split, ("train", "val"))
        return pack(self.train_tokens if split == "train" else self.val_tokens, seq_len)

    def val_text(self, seq_len: int, rows: int) -> Batch:
        """The first `rows` validation windows as (input_ids, labels) [rows, seq_len]."""
        w = self.text_windows("val", seq_len)[:rows]
        return w[:, :-1], w[:, 1:]

    def mqar(self, n: int, seq_len: int, num_kv_pairs: int, *, seed: int) -> Batch:
        """n MQAR rows (`glm5lab.evals.make_mqar_batch`) over this vocabulary."""
        return make_mqar_batch(self.tasks, n, seq_len, num_kv_pairs, seed=seed)

    def mixed(self, seq_len: int, batch_size: int, *, task_rows: int, num_kv_pairs: int, seed: int) -> BatchFn:
        """Batches of `batch_size - task_rows` shuffled training-text rows and `task_rows` fresh MQAR
        rows (different every step and stage), all `seq_len` long. Raises ValueError if task_rows
        is outside [0, batch_size]."""
        if not 0 <= task_rows <= batch_size:
            raise ValueError(f"task_rows = {task_rows} is not allowed: 0..batch_size={batch_size}")
        text = batch_size - task_rows
        stream = BatchStream(self.text_windows("train", seq_len), text, seed=seed) if text else None

        def batch(stage_index: int, stage: Stage, i: int) -> Batch:
            parts = []
            if stream is not None:
                w = stream.batch(stage_index * 100_003 + i)
                parts.append((w[:, :-1], w[:, 1:]))
            if task_rows:
                parts.append(self.mqar(task_rows, seq_len, num_kv_pairs,
                                       seed=derive_seed(seed, stage_index * 1_000_003 + i, "ablate-mqar")))
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

        return batch
