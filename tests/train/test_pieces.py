"""Long texts in pieces (`glm5lab.data.pieces`): the pieces encode to exactly the tokens of the whole text on
texts with tricky boundaries (long runs of spaces, newlines, unicode, one line without whitespace, added tokens
and contractions), for glm5lab's byte-level BPE and the Llama-3/GLM and Qwen2 pre-tokenizer patterns; a cutter
that also cuts where the anchors' proof does not hold fails on the same texts; pieces stay short however long
the text; tokenizers whose boundaries are not known are named, not cut; BPE trained on pieces is the same."""

from __future__ import annotations

import json
import random
import re

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from glm5lab.data.tokenizer import EOT, train_tokenizer
from glm5lab.data import pieces
from glm5lab.data.pieces import Cutter

TRICKY = {
    "spaces": "word" + " " * 3000 + "next  word   x\t \n  y " * 60 + " " * 200,
    "newlines": "line.\n\n\nline\r\n" * 100 + "\n" * 1000 + "end.\n" + "x!\n \n" * 100,
    "unicode": "caf\u00e9 na\u00efve e\u0301 \u4e2d\u6587\uff0c\u4e2d\u6587\u3002\u65e5\u672c\u8a9e "
               "\U0001f600\U0001f600 \u00bd \u2167 \u017ft \u212a\u00a0nbsp \u2028 " * 60,
    "one line without whitespace": "abc,def;ghi:123/jkl{\"k\":[1,2,3]}'s'll\u4e2d\u6587" * 100,
    "added tokens": "text<|endoftext|>more <|endoftext|> x<|end<|endoftext|><|endoftext|>y " * 60,
    "contractions": "it's we'll they're I'm you'd 'tis ''s 'S'LL 1'd " * 80,
}
SIZE = 40  # characters a piece: many cuts in every text
LLAMA3, QWEN2 = pieces.PATTERNS[1], pieces.PATTERNS[2]


def _trained(pattern: str | None) -> Tokenizer:
    """A BPE of 600 ids trained on the tricky texts (so merges span spaces, newlines, symbols): glm5lab's recipe
    (pattern None) or the ByteLevel BPE of a Split pre-tokenizer with `pattern` (GLM-4 / Llama-3 / Qwen2 style)."""
    tok = Tokenizer(models.BPE())
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[EOT, "<|user|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(TRICKY.values()), trainer)
    return tok


@pytest.fixture(scope="module", params=["glm5lab BPE (GPT-2 pattern)", "Llama-3 / GLM pattern", "Qwen2 pattern"])
def tok(request):
    return _trained({"glm5lab BPE (GPT-2 pattern)": None, "Llama-3 / GLM pattern": LLAMA3,
                     "Qwen2 pattern": QWEN2}[request.param])


def _ids(tok, texts) -> list[int]:
    return [i for enc in tok.encode_batch_fast(list(texts), add_special_tokens=False) for i in enc.ids]


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 30)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("name", list(TRICKY))
def test_pieces_encode_to_the_tokens_of_the_whole_text(tok, name):
    text, rng = TRICKY[name], random.Random(0)
    cutter, why = Cutter.of(tok, size=SIZE)
    assert why is None
    got = list(cutter.pieces(_chunks(text, rng)))
    assert "".join(got) == text and len(got) > 10
    assert _ids(tok, got) == _ids(tok, [text])


def test_random_texts_of_tricky_atoms(tok):
    atoms = [" ", "  ", "\n", "\n\n", "\r\n", "\t", "a", "Z", "word", "'s", "'ll", "'", "re", "1", "4567", ",", "!?",
             "\u00e9", "e\u0301", "\u4e2d", "\u3002", "\u00a0", "\U0001f600", EOT, "<|end", "oftext|>", "\u017f",
             "\u2028", "\x1c", "\u2167", "_", "<|user|>", "|>"]
    rng = random.Random(1)
    cutter, _ = Cutter.of(tok, size=8)
    for _ in range(400):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(2, 60)))
        assert _ids(tok, cutter.pieces(_chunks(text, rng))) == _ids(tok, [text]), repr(text)


class _Anywhere(Cutter):
    """Garbage: also cuts before any whitespace and between any two characters of different class."""

    def _anchor(self, buf, b):
        return super()._anchor(buf, b) or buf[b].isspace() or buf[b - 1].isalpha() != buf[b].isalpha()


def test_a_cutter_that_ignores_the_anchors_fails(tok, monkeypatch):
    monkeypatch.setattr(pieces, "_CANDIDATES", re.compile(r"(?<=.)(?=.)", re.S))
    cutter = _Anywhere(tok.pre_tokenizer, [EOT, "<|user|>"], size=SIZE)
    assert any(_ids(tok, cutter.pieces([t])) != _ids(tok, [t]) for t in TRICKY.values())


@pytest.mark.parametrize("repeats", [10, 100, 1000])
def test_pieces_stay_short_however_long_the_text(tok, repeats):
    """What a batch holds does not grow with the document: the longest piece is the same at 10x and 1000x."""
    text = "To be, or not to be: that is the question.\n\u4e2d\u6587\u3002 " * repeats
    cutter, _ = Cutter.of(tok, size=256)
    got = list(cutter.pieces(text[i:i + 1000] for i in range(0, len(text), 1000)))
    assert "".join(got) == text and max(map(len, got)) <= 256


def test_a_stretch_without_anchors_is_one_piece(tok):
    text = "a b " + "9" * 500 + " c" + " d" * 15
    got = list(Cutter.of(tok, size=SIZE)[0].pieces([text]))
    assert got == ["a b", " " + "9" * 500, " c" + " d" * 15] and _ids(tok, got) == _ids(tok, [text])


def test_tokenizers_whose_boundaries_are_not_known_are_encoded_whole():
    base = json.loads(_trained(None).to_str())

    def why(**change):
        return Cutter.of(Tokenizer.from_str(json.dumps({**base, **change})))[1]

    assert why() is None
    assert why(normalizer={"type": "NFC"}) == "its normalizer (NFC) may join characters across a cut"
    assert why(pre_tokenizer={"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always",
                              "split": True}).startswith("its pre-tokenizer ({\"type\": \"Metaspace\"")
    assert why(pre_tokenizer={**base["pre_tokenizer"], "add_prefix_space": True}).startswith("its pre-tokenizer")
    assert why(truncation={"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}) == \
        "it has truncation set"
    added = [{**base["added_tokens"][0], "lstrip": True}]
    assert why(added_tokens=added) == "its added token '<|endoftext|>' has lstrip set"
    glm = _trained(LLAMA3)
    assert Cutter.of(glm)[1] is None and isinstance(Cutter.of(glm)[0], Cutter)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    assert Cutter.of(tok)[0] is None


def test_bpe_trained_on_pieces_is_the_bpe_of_whole_texts(tmp_path):
    """glm5lab's trainer counts pre-tokens: pieces give the same counts, so the same merges, byte for byte (literal
    special tokens in the text included)."""
    from glm5lab.data.tokenizer import untrained_bpe

    texts = list(TRICKY.values())
    cutter, _ = Cutter.of(untrained_bpe(), size=SIZE)
    whole = train_tokenizer(texts, 500, tmp_path / "whole")
    cut = train_tokenizer((p for t in texts for p in cutter.pieces([t])), 500, tmp_path / "cut")
    assert cut.to_str() == whole.to_str()
