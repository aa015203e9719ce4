"""Bits per byte (`glm5lab.evals.bpb`): hand-computed values and errors, and byte counts that
add up exactly to the UTF-8 length of the text a real byte-level BPE encoded (non-ASCII and an
added non-special token included; the document separator counts 0 bytes)."""

import math

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, models

from glm5lab.evals.bpb import bits_per_byte, target_bytes, token_byte_lengths
from glm5lab.data.tokenizer import EOT, train_tokenizer
from glm5lab.data.corpus import Document
from tests.conftest import encode_whole

TEXTS = ["naïve café — ok, the naïve café is ok", "plain ascii words and more plain words",
         "Grüße aus Köln: 東京 ✓ ünïcödé"] * 20


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(TEXTS, 400, tmp_path_factory.mktemp("tok"))


def test_bits_per_byte_hand_computed():
    ln2 = math.log(2)
    assert bits_per_byte(10 * ln2, 5) == 2.0
    assert bits_per_byte(3 * ln2, 2) == 1.5
    assert bits_per_byte(0.0, 7) == 0.0
    assert bits_per_byte(1.0, 1) == pytest.approx(1 / ln2, rel=1e-15)


@pytest.mark.parametrize("nll, n_bytes, message", [
    (-1.0, 5, "nll_nats_sum = -1.0 is not allowed"),
    (float("nan"), 5, "nll_nats_sum = nan is not allowed"),
    (float("inf"), 5, "nll_nats_sum = inf is not allowed"),
    (1.0, 0, "utf8_bytes = 0 is not allowed"),
    (1.0, -3, "utf8_bytes = -3 is not allowed"),
])
def test_bits_per_byte_refuses_bad_input(nll, n_bytes, message):
    with pytest.raises(ValueError, match=message):
        bits_per_byte(nll, n_bytes)


def test_target_bytes_sums_scored_labels_and_skips_ignored():
    lengths = torch.tensor([0, 1, 2, 3])
    assert target_bytes(lengths, torch.tensor([[1, 2, -100], [3, -100, 0]])) == 6
    assert target_bytes(lengths, torch.full((2, 3), -100)) == 0
    assert target_bytes(lengths, torch.tensor([3, 3, 7]), ignore_index=7) == 6
    for bad in ([1, 4], [-5, 1]):
        with pytest.raises(ValueError, match=r"labels outside \[0, 4\)"):
            target_bytes(lengths, torch.tensor(bad))


@pytest.mark.parametrize("text", ["naïve café — ok", "hello world", "Grüße aus Köln: 東京 ✓", "unseen: Ωμέγα 🙂 ß",
                                  " leading and  double  spaces\nand a newline\t"])
def test_encoded_bytes_equal_the_texts_utf8_length(tokenizer, text):
    lengths = token_byte_lengths(tokenizer, 400)
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids)
    assert target_bytes(lengths, ids) == len(text.encode("utf-8"))


def test_separator_is_zero_bytes_and_documents_add_up(tokenizer):
    lengths = token_byte_lengths(tokenizer, 512)
    eot = tokenizer.token_to_id(EOT)
    assert tokenizer.get_vocab_size() > 300  # merges, not only the 256 byte symbols
    assert lengths[eot] == 0 and lengths.dtype == torch.int64 and lengths.shape == (512,)
    assert (lengths[tokenizer.get_vocab_size():] == 0).all()  # ids past the tokenizer: 0 bytes
    assert (lengths[[i for i in range(tokenizer.get_vocab_size()) if i != eot]] >= 1).all()
    docs = [Document("a", "naïve café — ok"), Document("b", "東京 ✓"), Document("c", "plain")]
    ids = torch.from_numpy(encode_whole(tokenizer, docs))
    assert (ids == eot).sum() == 2
    assert target_bytes(lengths, ids) == sum(len(d.text.encode("utf-8")) for d in docs)


def test_added_non_special_token_counts_its_utf8_content(tmp_path):
    tok = train_tokenizer(TEXTS, 400, tmp_path)
    tok.add_tokens([AddedToken("naïve✓", special=False)])
    new = tok.token_to_id("naïve✓")
    lengths = token_byte_lengths(tok, tok.get_vocab_size())
    assert lengths[new] == len("naïve✓".encode("utf-8")) == 9  # 6 characters, 9 bytes
    text = "a naïve✓ café"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert new in ids and target_bytes(lengths, torch.tensor(ids)) == len(text.encode("utf-8"))


def test_vocab_size_below_the_tokenizer_and_non_byte_level_are_refused(tokenizer):
    with pytest.raises(ValueError, match="vocab_size = 300 is below the tokenizer's"):
        token_byte_lengths(tokenizer, 300)
    word_level = Tokenizer(models.WordLevel({"[UNK]": 0, "▁hello": 1}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match="decoder is NoneType, not ByteLevel"):
        token_byte_lengths(word_level, 2)
    from tokenizers import decoders

    word_level.decoder = decoders.ByteLevel()  # a ByteLevel decoder over tokens outside its alphabet
    with pytest.raises(ValueError, match="not in GPT-2's ByteLevel alphabet"):
        token_byte_lengths(word_level, 2)


def test_non_byte_level_tokenizers_are_refused():
    """A WordPiece vocabulary of ASCII pieces passes an alphabet check but its token lengths are
    not bytes ("##ing" is 3 bytes of text, 5 characters): refused by its decoder."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "play": 1, "##ing": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="decoder is WordPiece, not ByteLevel"):
        token_byte_lengths(tok, 3)


def test_summary_of_a_diverged_run_is_still_written():
    import math

    from glm5lab.train.evaluation import Evaluation, summary_fields

    nan = summary_fields(Evaluation(math.nan, 10, 10))
    assert math.isnan(nan["val_loss"]) and math.isnan(nan["val_bits_per_byte"])
    assert summary_fields(Evaluation(8000.0, 10, 10))["val_perplexity"] == math.inf
