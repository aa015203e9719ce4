"""`glm5lab train --data DIR` on a token folder, and `--data TEXT` on the cached token folder of its text: the
same tokens either way, also for a raw folder of text, JSONL and parquet files (one reader); the cache's key
(corpus, seed, tokenizer); memmap windows give the batches (world sizes 1 and 2, several steps, an epoch boundary),
validation windows and scores, and unigram baseline of the tokens held in memory; bad folders are refused in one
line; a run seed other than the folder's split seed is said."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from glm5lab.data.tokenizer import load_tokenizer, train_tokenizer
from glm5lab.data.batches import BatchStream, pack, unigram_loss
from glm5lab.data.pipeline import prepare_data
from glm5lab.train.evaluation import evaluate_nll
from glm5lab.data.shards import ShardedTokens, TokenWindows, open_token_folder
from glm5lab.train.stages import Stage
from glm5lab.data.tokenize import ShardWriter, tokenize_corpus
from tests.conftest import reference_split, write_word_corpus

VOCAB = 320
SHARD = 700  # tokens per shard: windows of 17 tokens cross shard boundaries


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """(text corpus, its token folder) with the trained, cached BPE of `prepare_data`."""
    monkeypatch.setenv("GLM5LAB_CACHE", str(tmp_path / "cache"))
    texts = write_word_corpus(tmp_path / "texts", docs=8, words_per_doc=400)
    tokenize_corpus(texts, tmp_path / "tokens", vocab_size=VOCAB, shard_size=SHARD, seed=0, progress=False)
    return texts, tmp_path / "tokens"


def test_a_text_corpus_trains_from_its_cached_token_folder(folders, tmp_path):
    """`--data TEXT` tokenizes once into `$GLM5LAB_CACHE/tokens/` (said in one line), then reuses the folder: the
    tokens of `glm5lab tokenize TEXT`. Another seed, another tokenizer or a changed file gets another folder; a given
    tokenizer that is the trained one (a resumed run's) reuses the trained folder."""
    texts, tokens = folders
    said = []
    text = prepare_data(VOCAB, str(texts), 0, say=said.append)
    assert said == [f"tokenizing {texts} (split seed 0, byte-level BPE, vocab_size {VOCAB}) once into the cache: "
                    f"{text.train_tokens.files[0].parent}"]
    folder = text.train_tokens.files[0].parent
    assert folder.parent == tmp_path / "cache" / "tokens" and folder.name.startswith("texts-")
    assert folder.name.endswith(f"-bpe{VOCAB}") and text.source == str(texts)
    lazy = prepare_data(VOCAB, str(tokens), 0)
    assert isinstance(text.train_tokens, ShardedTokens) and len(lazy.train_tokens.files) > 2
    assert text.tokenizer.to_str() == lazy.tokenizer.to_str()
    assert np.array_equal(np.asarray(text.train_tokens), np.asarray(lazy.train_tokens))  # ids match exactly
    assert np.array_equal(np.asarray(text.val_tokens), np.asarray(lazy.val_tokens))
    assert prepare_data(VOCAB, str(texts), 0, say=said.append).train_tokens.files[0].parent == folder and len(said) == 1
    (checkpoint := tmp_path / "ckpt").mkdir()
    (checkpoint / "tokenizer.json").write_text(lazy.tokenizer.to_str())
    kept = prepare_data(VOCAB, str(texts), 0, checkpoint=checkpoint, say=said.append)
    assert kept.train_tokens.files[0].parent == folder and len(said) == 1
    other_seed = prepare_data(VOCAB, str(texts), 3, say=said.append).train_tokens.files[0].parent
    train_tokenizer(["another corpus entirely, another vocabulary"] * 30, 290, tmp_path / "other")
    other_tok = prepare_data(VOCAB, str(texts), 0, tokenizer=str(tmp_path / "other"), say=said.append)
    (texts / "doc0.txt").write_text((texts / "doc0.txt").read_text() + " and more")
    changed = prepare_data(VOCAB, str(texts), 0, say=said.append).train_tokens.files[0].parent
    folders_made = {folder, other_seed, other_tok.train_tokens.files[0].parent, changed}
    assert len(folders_made) == 4 and len(said) == 4 and other_tok.index["split"]["seed"] == 0
    assert other_tok.tokenizer.to_str() == load_tokenizer(tmp_path / "other").to_str()
    assert not list((tmp_path / "cache" / "tokens").glob(".*"))  # no staging folder left


def test_a_raw_folder_and_its_token_folder_are_one_corpus(tmp_path, monkeypatch):
    """Issue 36: `train --data FOLDER` reads the .parquet (and .arrow) files `tokenize FOLDER` reads, through the
    same reader: the same documents, tokenizer, train/val tokens and unigram baseline either way."""
    datasets = pytest.importorskip("datasets")
    from glm5lab.data.corpus import split_documents
    from glm5lab.data.sources import open_corpus

    monkeypatch.setenv("GLM5LAB_CACHE", str(tmp_path / "cache"))
    raw = write_word_corpus(tmp_path / "raw", docs=5, words_per_doc=200)
    (raw / "rows.jsonl").write_text("".join(json.dumps({"text": f"row {i} of the jsonl file"}) + "\n"
                                            for i in range(30)))
    rows = [" ".join(["the king", "the sea", "a fool"][(i + j) % 3] for j in range(30)) for i in range(70)]
    datasets.Dataset.from_dict({"text": rows}).to_parquet(str(raw / "table.parquet"))
    train_docs, val_docs = split_documents(list(open_corpus(raw).documents()), seed=0)
    assert {"table.parquet", "rows.jsonl"} <= {d.name.split(":")[0] for d in val_docs}  # both reach validation
    tokenize_corpus(raw, tmp_path / "tokens", vocab_size=VOCAB, progress=False)
    text, lazy = prepare_data(VOCAB, str(raw), 0), prepare_data(VOCAB, str(tmp_path / "tokens"), 0)
    assert lazy.tokenizer.to_str() == text.tokenizer.to_str()
    train_ids, val_ids = reference_split(lazy.tokenizer, raw)
    for data in (lazy, text):
        assert np.array_equal(np.asarray(data.train_tokens), train_ids)
        assert np.array_equal(np.asarray(data.val_tokens), val_ids)
    index = open_token_folder(tmp_path / "tokens").index
    assert index["splits"]["val"]["documents"] == len(val_docs) and index["splits"]["train"]["documents"] == len(
        train_docs) == 5 + 30 + 70 - len(val_docs)


def test_a_run_seed_other_than_the_folders_split_seed_is_said(folders):
    """Issue 36: the split is the folder's (its `glm5lab tokenize --seed`); a run with another --seed is told so in
    one line, once; the same seed says nothing."""
    texts, tokens = folders
    said = []
    same = prepare_data(VOCAB, str(tokens), 0, say=said.append)
    assert said == []
    other = prepare_data(VOCAB, str(tokens), 7, say=said.append)
    assert said == [f"token folder {tokens} was split into training and validation with seed 0 (glm5lab tokenize "
                    "--seed 0); --seed 7 seeds the initialisation and the batch order only"]
    assert np.array_equal(np.asarray(other.val_tokens), np.asarray(same.val_tokens))  # the folder's split either way


@pytest.mark.parametrize("world_size", [1, 2])
def test_same_batches_per_rank_and_step(folders, world_size):
    """Memmap windows (`TokenWindows`) give the batches of the same tokens held in memory."""
    texts, tokens = folders
    lazy = prepare_data(VOCAB, str(tokens), 0)
    seq_len, batch = 16, 3
    windows_mem, windows_lazy = pack(np.asarray(lazy.train_tokens), seq_len), pack(lazy.train_tokens, seq_len)
    assert isinstance(windows_lazy, TokenWindows) and windows_lazy.shape == windows_mem.shape
    for rank in range(world_size):
        a = BatchStream(windows_mem, batch, seed=5, rank=rank, world_size=world_size)
        b = BatchStream(windows_lazy, batch, seed=5, rank=rank, world_size=world_size)
        steps = [0, 1, 2, a.steps_per_epoch - 1, a.steps_per_epoch, a.steps_per_epoch + 3]  # an epoch boundary
        for step in steps:
            x, y = a.batch(step), b.batch(step)
            assert y.dtype == torch.int64 and torch.equal(x, y), (rank, step)
        resumed = BatchStream(pack(lazy.train_tokens, seq_len), batch, seed=5, rank=rank, world_size=world_size)
        assert torch.equal(resumed.batch(steps[-1]), a.batch(steps[-1]))  # resumable at any step


def test_same_validation_windows_scores_and_unigram(folders, monkeypatch):
    texts, tokens = folders
    lazy = prepare_data(VOCAB, str(tokens), 0)
    train_mem, val_mem_ids = np.asarray(lazy.train_tokens), np.asarray(lazy.val_tokens)  # the tokens in memory
    val_mem, val_lazy = pack(val_mem_ids, 16), pack(lazy.val_tokens, 16)
    assert torch.equal(val_lazy[:], val_mem) and torch.equal(val_lazy[:4], val_mem[:4])
    assert torch.equal(val_lazy[len(val_mem) - 1], val_mem[-1])
    model = _BigramModel(VOCAB)
    stage = Stage("dense", 1, 1e-3, 16, 2)
    lengths = torch.arange(VOCAB, dtype=torch.int64) % 3 + 1
    for n_windows in (None, 4):
        a = evaluate_nll(model, val_mem, stage, n_windows, byte_lengths_V=lengths)
        b = evaluate_nll(model, val_lazy, stage, n_windows, byte_lengths_V=lengths)
        assert (a.tokens, a.utf8_bytes) == (b.tokens, b.utf8_bytes) and a.nll_sum == b.nll_sum
    ref = unigram_loss(train_mem, val_mem_ids, VOCAB)
    assert unigram_loss(lazy.train_tokens, lazy.val_tokens, VOCAB) == ref  # one chunk each: the same sums
    monkeypatch.setattr(ShardedTokens.chunks, "__defaults__", (50,))
    got = unigram_loss(lazy.train_tokens, lazy.val_tokens, VOCAB)
    assert math.isclose(got, ref, rel_tol=1e-12), (got, ref)  # fp64 sums in another order
    assert not math.isclose(unigram_loss(lazy.val_tokens, lazy.val_tokens, VOCAB), ref, rel_tol=1e-6)  # garbage fails


class _BigramModel(torch.nn.Module):
    """A deterministic stand-in with the model's call signature: logits from an embedding of the input ids."""

    def __init__(self, vocab: int):
        super().__init__()
        self.table = torch.nn.Embedding(vocab, vocab)
        torch.nn.init.normal_(self.table.weight, generator=torch.Generator().manual_seed(0))

    def forward(self, ids, use_dsa=False):
        return type("Out", (), {"logits": self.table(ids)})()


def test_reads_within_and_across_shards(tmp_path):
    ids = np.random.default_rng(0).integers(0, 60000, size=2500).astype(np.int64)
    w = ShardWriter(tmp_path, "train", "uint16", 1000)
    w.append(ids[:10])
    w.append(ids[10:])
    shards = w.close()
    assert [s["tokens"] for s in shards] == [1000, 1000, 500]
    t = ShardedTokens([tmp_path / s["file"] for s in shards], [s["tokens"] for s in shards], "uint16")
    for a, b in [(0, 2500), (990, 1010), (999, 2001), (1000, 1000), (2499, 2500), (5, 7)]:
        assert np.array_equal(t[a:b], ids[a:b])
    assert np.array_equal(np.concatenate(list(t.chunks(333))), ids)
    windows = TokenWindows(t, 9)
    assert torch.equal(windows[torch.tensor([99, 0, 100])], torch.from_numpy(ids[:2500].reshape(250, 10)[[99, 0, 100]]))


def _break(tokens, edit):
    index = json.loads((tokens / "index.json").read_text())
    edit(index)
    (tokens / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("damage, message", [
    (lambda d: os.truncate(d / "train-000001.bin", 10), r"shard train-000001.bin holds 10 bytes but index.json says "
                                                        r"700 uint16 tokens = 1,400 bytes \(truncated"),
    (lambda d: (d / "val-000000.bin").unlink(), r"shard val-000000.bin listed in index.json is missing"),
    (lambda d: (d / "index.json").unlink(), r"has no index.json: not a token folder \(an interrupted"),
    (lambda d: (d / "index.json").write_text("{"), r"index.json is not valid JSON"),
    (lambda d: _break(d, lambda i: i.update(version=7)), r"version = 7 is not allowed: 1"),
    (lambda d: _break(d, lambda i: i.update(dtype="int8")), r"dtype = 'int8' is not allowed: uint16 or uint32"),
    (lambda d: _break(d, lambda i: i["splits"].pop("val")), r"splits.val.shards = None is not allowed"),
    (lambda d: _break(d, lambda i: i.update(tokenizer_sha256="0" * 64)), r"its tokenizer.json \(sha256 \w+\) is not the "
                                                                        r"one its shards were written with"),
])
def test_bad_folders_are_refused_in_one_line(folders, damage, message):
    _, tokens = folders
    damage(tokens)
    with pytest.raises(ValueError, match=message) as e:
        prepare_data(VOCAB, str(tokens), 0)
    assert "\n" not in str(e.value)


def test_another_tokenizer_is_refused(folders, tmp_path):
    texts, tokens = folders
    other = train_tokenizer(["a completely different corpus " * 50], 280, tmp_path / "other")
    with pytest.raises(ValueError, match=r"--tokenizer = '.*other' is not allowed: token folder .* holds another "
                                         r"tokenizer's shards"):
        prepare_data(VOCAB, str(tokens), 0, tokenizer=str(tmp_path / "other"))
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "tokenizer.json").write_text(other.to_str())
    with pytest.raises(ValueError, match=r"checkpoint .*ckpt was trained with another tokenizer .* resume with another "
                                         r"tokenizer is not allowed"):
        prepare_data(VOCAB, str(tokens), 0, checkpoint=checkpoint)
    (checkpoint / "tokenizer.json").write_text(open_token_folder(tokens).tokenizer_file.read_text())
    prepare_data(VOCAB, str(tokens), 0, checkpoint=checkpoint, tokenizer=str(tokens))  # its own: accepted
    with pytest.raises(ValueError, match=r"its tokenizer has 304 tokens but the model's vocab_size is 300"):
        prepare_data(300, str(tokens), 0)


def test_cli_train_on_a_token_folder_and_init_with_another_tokenizer(folders, tmp_path):
    import subprocess
    import sys

    texts, tokens = folders
    env = {**os.environ, "GLM5LAB_CACHE": str(tmp_path / "cache")}

    def train(*args):
        return subprocess.run([sys.executable, "-m", "glm5lab", "train", "--seq-len", "16",
                               "--batch-size", "2", "--no-progress", "--threads", "1", *args],
                              capture_output=True, text=True, env=env, timeout=300)
    r = train("--preset", "tiny", "--data", str(tokens), "--steps", "3", "--eval-every", "0", "--seed", "1",
              "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("was split into training and validation with seed 0 (glm5lab tokenize --seed 0); --seed 1 "
                          "seeds the initialisation and the batch order only") == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    memory = prepare_data(512, str(texts), 0)
    assert math.isclose(summary["unigram_val_loss"], unigram_loss(memory.train_tokens, memory.val_tokens, 512),
                        rel_tol=1e-12)
    assert summary["val_tokens"] == len(pack(memory.val_tokens, 16)) * 16
    other = tmp_path / "other"
    write_word_corpus(other, docs=4, words_per_doc=300, words="to be or not that is the question".split())
    tokenize_corpus(other, tmp_path / "other-tokens", vocab_size=290, shard_size=SHARD, progress=False)
    r = train("--data", str(tmp_path / "other-tokens"), "--steps", "3", "--init", str(tmp_path / "run"),
              "--out", str(tmp_path / "run2"))
    assert r.returncode == 2 and "resume with another tokenizer is not allowed" in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


def test_held_out_prompts_from_a_token_folder(folders, tmp_path):
    from glm5lab.data.pipeline import held_out_prompts

    texts, tokens = folders
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "tokenizer.json").write_text(open_token_folder(tokens).tokenizer_file.read_text())
    a, info_a = held_out_prompts(checkpoint, 3, 12, data=str(texts))
    b, info_b = held_out_prompts(checkpoint, 3, 12, data=str(tokens))
    assert a == b and info_a["val_tokens"] == info_b["val_tokens"] and info_a["val_documents"] == info_b["val_documents"]
