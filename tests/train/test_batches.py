"""Packing, deterministic resumable sharded batches, the unigram baseline, and the whole pipeline."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from glm5lab.data.batches import BatchStream, pack, unigram_loss
from glm5lab.data.pipeline import prepare_data
from glm5lab.data.tokenizer import eot_id


def _windows(n: int = 50, seq_len: int = 4) -> torch.Tensor:
    return pack(np.arange(n * (seq_len + 1), dtype=np.int32), seq_len)


def test_pack_shapes_and_contents():
    tokens = np.arange(23, dtype=np.int32)
    w = pack(tokens, 4)
    assert w.dtype == torch.int64 and w.shape == (4, 5)
    assert w.tolist() == [list(range(i * 5, i * 5 + 5)) for i in range(4)]  # tail 20..22 dropped
    assert pack(tokens, 22).tolist() == [list(range(23))]


def test_pack_errors():
    with pytest.raises(ValueError, match=r"5 tokens do not fill one window of seq_len \+ 1 = 6"):
        pack(np.arange(5), 5)
    with pytest.raises(ValueError, match="seq_len = 0"):
        pack(np.arange(5), 0)
    with pytest.raises(ValueError, match="1-D"):
        pack(np.zeros((2, 8), dtype=np.int32), 3)


def test_an_epoch_visits_distinct_windows_and_epochs_differ():
    windows = _windows(50)
    stream = BatchStream(windows, batch_size=4, seed=0)
    assert stream.steps_per_epoch == 12
    epoch0 = torch.cat([stream.batch(s) for s in range(12)])
    epoch1 = torch.cat([stream.batch(s) for s in range(12, 24)])
    for epoch in (epoch0, epoch1):
        assert epoch.shape == (48, 5) and epoch.dtype == torch.int64
        assert len({tuple(r) for r in epoch.tolist()}) == 48
        assert {tuple(r) for r in epoch.tolist()} <= {tuple(r) for r in windows.tolist()}
    assert not torch.equal(epoch0, epoch1)
    assert stream.position(0) == (0, 0) and stream.position(13) == (1, 1) and stream.position(35) == (2, 11)


def test_batch_of_a_step_does_not_depend_on_history():
    windows = _windows(37)
    run = BatchStream(windows, batch_size=3, seed=7)
    uninterrupted = [run.batch(s) for s in range(40)]
    resumed = BatchStream(windows.clone(), batch_size=3, seed=7)
    for s in (25, 3, 39, 12, 0):
        assert torch.equal(resumed.batch(s), uninterrupted[s])
    assert not torch.equal(BatchStream(windows, 3, seed=8).batch(0), uninterrupted[0])


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_together_see_the_single_rank_global_batch(world_size):
    windows = _windows(61)
    single = BatchStream(windows, batch_size=2 * world_size, seed=5)
    ranks = [BatchStream(windows, batch_size=2, seed=5, rank=r, world_size=world_size)
             for r in range(world_size)]
    for step in (0, 1, 7, 40):
        shards = [r.batch(step) for r in ranks]
        assert torch.equal(torch.cat(shards), single.batch(step))
        assert all(s.shape == (2, 5) for s in shards)
        rows = {tuple(r) for s in shards for r in s.tolist()}
        assert len(rows) == 2 * world_size  # disjoint


def test_stream_errors():
    windows = _windows(10)
    for kwargs, match in [(dict(batch_size=0), "batch_size = 0"),
                          (dict(batch_size=2, world_size=0), "world_size = 0"),
                          (dict(batch_size=2, rank=2, world_size=2), "rank = 2"),
                          (dict(batch_size=2, rank=-1, world_size=2), "rank = -1"),
                          (dict(batch_size=4, world_size=3), "global batch .* 12 exceeds the 10 windows")]:
        with pytest.raises(ValueError, match=match):
            BatchStream(windows, seed=0, **kwargs)
    with pytest.raises(ValueError, match="seq_len"):
        BatchStream(windows[0], batch_size=1, seed=0)
    with pytest.raises(ValueError, match="step = -1"):
        BatchStream(windows, batch_size=2, seed=0).batch(-1)


def test_unigram_loss_by_hand():
    train, val = np.array([0, 0, 0, 1], dtype=np.int32), np.array([0, 1, 3])
    p = np.array([4, 2, 1, 1]) / 8
    expected = -(math.log(p[0]) + math.log(p[1]) + math.log(p[3])) / 3
    assert unigram_loss(train, val, 4) == pytest.approx(expected, rel=1e-12)
    assert unigram_loss(np.array([], dtype=np.int64), val, 4) == pytest.approx(math.log(4), rel=1e-12)
    assert unigram_loss(train, np.array([0, 0]), 4) < unigram_loss(train, np.array([2, 3]), 4)


def test_unigram_loss_errors():
    with pytest.raises(ValueError, match="val_tokens is empty"):
        unigram_loss(np.array([1]), np.array([], dtype=np.int64), 4)
    with pytest.raises(ValueError, match=r"val_tokens has ids in \[0, 4\], outside \[0, vocab_size=4\)"):
        unigram_loss(np.array([1]), np.array([0, 4]), 4)
    with pytest.raises(ValueError, match="train_tokens has ids in \\[-1"):
        unigram_loss(np.array([-1]), np.array([0]), 4)
    with pytest.raises(ValueError, match="integer"):
        unigram_loss(np.array([1.0]), np.array([0]), 4)


def test_pipeline_end_to_end(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    words = ["thou", "art", "more", "lovely", "and", "temperate", "rough", "winds", "do", "shake"]
    for i in range(12):
        (data / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, size=300)) + "\n")
    monkeypatch.setenv("GLM5LAB_CACHE", str(tmp_path / "cache"))
    prepared = prepare_data(320, str(data), 0, say=lambda message: None)
    tok, train_ids, val_ids = prepared.tokenizer, prepared.train_tokens, prepared.val_tokens
    assert (np.asarray(train_ids) == eot_id(tok)).sum() == prepared.index["splits"]["train"]["documents"] - 1
    stream = BatchStream(pack(train_ids, 16), batch_size=4, seed=0)
    batch = stream.batch(3)
    assert batch.shape == (4, 17) and batch.dtype == torch.int64
    loss = unigram_loss(train_ids, val_ids, tok.get_vocab_size())
    assert 0 < loss < math.log(tok.get_vocab_size())
