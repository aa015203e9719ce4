"""Byte-level BPE: determinism, round trips, the document separator, caching and loading."""

from __future__ import annotations

import json

import pytest

from glm5lab.data import tokenizer as tok_mod
from glm5lab.data.tokenizer import (
    EOT, cached_tokenizer, eot_id, load_tokenizer, train_tokenizer,
)
from glm5lab.data.corpus import Document

TEXTS = [
    "The quick brown fox jumps over the lazy dog.\n\n" * 3,
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.\n",
    "numbers 0123456789 and tabs\tand  double  spaces\n",
]
TRICKY = "caf\u00e9 \u4e2d\u6587 \U0001f600 \x00 \r\n\t  end"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(TEXTS, 300, tmp_path_factory.mktemp("tok"))


def test_training_is_deterministic_to_the_byte(tmp_path):
    train_tokenizer(TEXTS, 320, tmp_path / "a")
    train_tokenizer(iter(TEXTS), 320, tmp_path / "b" / "tokenizer.json")
    first = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert first == (tmp_path / "b" / "tokenizer.json").read_bytes()
    train_tokenizer(TEXTS[::-1] + ["more text, more merges"], 320, tmp_path / "c")
    assert first != (tmp_path / "c" / "tokenizer.json").read_bytes()


def test_recipe(tok):
    spec = json.loads(tok.to_str())
    assert spec["model"]["type"] == "BPE"
    assert spec["pre_tokenizer"]["type"] == "ByteLevel" and spec["decoder"]["type"] == "ByteLevel"
    assert [t["content"] for t in spec["added_tokens"]] == [EOT]
    assert tok.get_vocab_size() == 300 and eot_id(tok) == 0


@pytest.mark.parametrize("text", [TEXTS[1], TRICKY, "unseen words: zyxwvut qjq"])
def test_any_text_round_trips(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    assert all(0 < i < tok.get_vocab_size() for i in ids)


def test_bpe_merges_compress_the_training_text(tok):
    text = TEXTS[0]
    assert len(tok.encode(text).ids) < len(text.encode()) / 2


def test_vocab_size_too_small(tmp_path):
    with pytest.raises(ValueError, match="vocab_size = 256"):
        train_tokenizer(TEXTS, 256, tmp_path)
    assert not tmp_path.joinpath("tokenizer.json").exists()


def test_load_file_folder_and_checkpoint_folder(tok, tmp_path):
    tok.save(str(tmp_path / "tokenizer.json"))
    for name in ("config.json", "tokenizer_config.json", "model.safetensors.index.json"):
        (tmp_path / name).write_text("{}")
    for path in (tmp_path, tmp_path / "tokenizer.json"):
        assert load_tokenizer(path).to_str() == tok.to_str()


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer at .*missing"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json file or a folder"):
        load_tokenizer(tmp_path)


def test_cached_tokenizer_trains_once_per_data_and_vocab(tmp_path, monkeypatch):
    calls = []
    real_train = tok_mod.train_tokenizer
    monkeypatch.setattr(tok_mod, "train_tokenizer", lambda *a: calls.append(a[1]) or real_train(*a))
    docs = lambda texts: lambda: (Document(f"d{i}", t) for i, t in enumerate(texts))  # noqa: E731
    first = cached_tokenizer(docs(TEXTS), 300, tmp_path)
    again = cached_tokenizer(docs(TEXTS), 300, tmp_path)
    assert again.to_str() == first.to_str() and calls == [300]
    cached_tokenizer(docs(TEXTS[:-1]), 300, tmp_path)
    cached_tokenizer(docs(TEXTS), 310, tmp_path)
    cached_tokenizer(docs(["".join(TEXTS[:2])] + TEXTS[2:]), 300, tmp_path)  # same characters, other split
    assert calls == [300, 300, 310, 300]
    assert len(list(tmp_path.glob("tokenizer-v*/tokenizer.json"))) == 4


