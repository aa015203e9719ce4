"""`glm5lab tokenize`: a text file read in chunks equals it read whole, the split's fallbacks, parquet/arrow through
`datasets`, shards equal the documents encoded whole and joined by <|endoftext|> (long documents too, encoded in
pieces), an interrupted run leaves no index and no half-written shard, and one-line refusals."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from glm5lab.cli import main
from glm5lab.data.tokenizer import load_tokenizer, train_tokenizer
from glm5lab.data.corpus import Document, split_documents, split_score
from glm5lab.data.pipeline import prepare_data
from glm5lab.data.shards import ShardedTokens, dtype_for, open_token_folder
from glm5lab.data.sources import TextFile, open_corpus
from glm5lab.data.tokenize import ShardWriter, tokenize_corpus
from tests.conftest import encode_whole, reference_split, write_word_corpus

VOCAB = 300


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GLM5LAB_CACHE", str(tmp_path / "cache"))


def test_a_text_file_read_in_chunks_equals_it_read_whole(tmp_path, monkeypatch):
    """`TextFile` decodes as `Path.read_text(encoding="utf-8-sig")`: BOM, CRLF and lone CR, multi-byte characters
    and a CRLF cut between two reads; `part` and the one-document split read only what they need."""
    from glm5lab.data import sources

    path = tmp_path / "t.txt"
    path.write_bytes("\ufeffab\r\ncd\re\u00e9\u4e2d\U0001f600\r\n\r\nend\r".encode())
    whole = path.read_text(encoding="utf-8-sig")
    for block in (1, 2, 3, 5, 64):
        monkeypatch.setattr(sources, "READ_BYTES", block)
        doc = next(open_corpus(path).documents())
        assert isinstance(doc, TextFile) and doc.text == whole
        assert max(len(c) for c in doc.chunks()) <= block + 1  # + a CR held back from the read before
        assert doc.part("p", 3, 9).text == whole[3:9]
        assert [(d.name, d.text) for d in split_documents([doc], 0.4)[0] + split_documents([doc], 0.4)[1]] == [
            (d.name, d.text) for d in sum(split_documents([Document("t.txt", whole)], 0.4), [])]


@pytest.mark.parametrize("n_docs", [1, 2, 40])
def test_shards_are_the_split_documents_encoded_whole_and_joined(tmp_path, n_docs):
    """1 document: its text is cut; 2: no document scores below 0.05 with seed 0, the lowest moves to val; 40: some
    do, no fallback. Each split decodes back to its documents, cut at <|endoftext|>."""
    texts = write_word_corpus(tmp_path / "texts", docs=n_docs, words_per_doc=300)
    index = tokenize_corpus(texts, tmp_path / "tok", vocab_size=VOCAB, shard_size=250, progress=False)
    folder = open_token_folder(tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    train_ids, val_ids = reference_split(tok, texts)
    assert np.array_equal(np.asarray(folder.train), train_ids)
    assert np.array_equal(np.asarray(folder.val), val_ids)
    train_docs, val_docs = split_documents(list(open_corpus(texts).documents()), seed=0)
    parts = np.split(val_ids, np.flatnonzero(val_ids == tok.token_to_id("<|endoftext|>")))
    assert [tok.decode(p.tolist()) for p in parts] == [d.text for d in val_docs]
    assert index["splits"]["train"]["documents"] == len(train_docs) and index["splits"]["val"]["documents"] == len(val_docs)
    assert index["split"]["single"] == (None if n_docs > 1 else "doc0.txt")
    natural = any(split_score(d.name, 0) < 0.05 for d in open_corpus(texts).documents())
    assert (index["split"]["moved"] is not None) == (n_docs > 1 and not natural) and natural == (n_docs == 40)
    assert all(s["tokens"] == 250 for s in index["splits"]["train"]["shards"][:-1]) and index["dtype"] == "uint16"


def _datasets():
    return pytest.importorskip("datasets")


def test_parquet_and_arrow_through_datasets(tmp_path):
    datasets = _datasets()
    rows = [" ".join(["the king", "the sea", "a fool"][i % 3] for _ in range(20 + i)) for i in range(30)]
    table = datasets.Dataset.from_dict({"id": list(range(30)), "body": rows})
    (tmp_path / "pq").mkdir()
    table.to_parquet(str(tmp_path / "pq" / "part-0.parquet"))
    table.save_to_disk(str(tmp_path / "arrow"))
    tok = train_tokenizer(rows, VOCAB, tmp_path / "tk")
    docs = [Document(f"part-0.parquet:{i}", t) for i, t in enumerate(rows)]
    assert list(open_corpus(tmp_path / "pq", "body").documents()) == docs
    train, val = split_documents(docs, seed=0)
    index = tokenize_corpus(tmp_path / "pq", tmp_path / "t1", tokenizer=tmp_path / "tk", vocab_size=VOCAB,
                            text_field="body", shard_size=100, progress=False)
    folder = open_token_folder(tmp_path / "t1")
    assert np.array_equal(np.asarray(folder.train), encode_whole(tok, train))
    assert np.array_equal(np.asarray(folder.val), encode_whole(tok, val))
    assert index["text_field"] == "body" and index["splits"]["val"]["documents"] == len(val)
    arrow_docs = list(open_corpus(tmp_path / "arrow", "body").documents())
    assert [d.text for d in arrow_docs] == rows and arrow_docs[0].name == "data-00000-of-00001.arrow:0"
    with pytest.raises(ValueError, match=r"part-0.parquet has no column 'text' \(its columns: id, body\); name the "
                                         r"text column with `glm5lab tokenize .*pq --text-field NAME --out DIR` "
                                         r"\(then `glm5lab train --data DIR`\)$"):
        tokenize_corpus(tmp_path / "pq", tmp_path / "t2", tokenizer=tmp_path / "tk", vocab_size=VOCAB, progress=False)
    assert not (tmp_path / "t2").exists()  # a failed tokenize leaves no folder it made


def test_empty_corrupt_and_non_string_tables(tmp_path, capsys):
    """Issue 36: a table without rows in a folder is skipped and named like an empty .txt (refused given as DATA);
    an unreadable one, or a cell that is not a non-blank string, is refused naming the file (and row)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    datasets = _datasets()
    folder = tmp_path / "f"
    write_word_corpus(folder, docs=3, words_per_doc=50)
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), folder / "z.parquet")  # one row group of 0 rows
    schema = pa.schema([("text", pa.string())])
    with pa.OSFile(str(folder / "y.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema):
        pass  # an arrow stream (save_to_disk's layout) without batches
    with pa.OSFile(str(folder / "x.arrow"), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
        w.write_table(pa.table({"text": pa.array([], pa.string())}))  # an arrow file, one batch of 0 rows
    docs = list(open_corpus(folder).documents())
    assert [d.name for d in docs] == ["doc0.txt", "doc1.txt", "doc2.txt"]
    assert capsys.readouterr().err == (f"glm5lab: corpus folder {folder}: reading its 3 .txt/.md/.jsonl/.parquet/"
                                       ".arrow files; skipping 3 empty files: x.arrow, y.arrow, z.parquet\n")
    for name in ("z.parquet", "y.arrow", "x.arrow"):
        with pytest.raises(ValueError, match=rf"{name} is empty: the table has no rows$"):
            list(open_corpus(folder / name).documents())
    (folder / "bad.parquet").write_bytes(b"not a parquet file" * 10)
    with pytest.raises(ValueError, match=r"bad.parquet: not a readable parquet file \(.*magic bytes"):
        tokenize_corpus(folder, tmp_path / "t", vocab_size=VOCAB, progress=False)
    assert not (tmp_path / "t").exists()
    (folder / "bad.parquet").unlink()
    datasets.Dataset.from_dict({"text": [1, 2]}).to_parquet(str(folder / "i.parquet"))
    with pytest.raises(ValueError, match=r"i.parquet, row 0: column 'text' holds an int \(1\), not a string$"):
        list(open_corpus(folder).documents())


def test_an_interrupted_run_leaves_no_index_and_no_partial_shard(tmp_path, monkeypatch):
    texts = write_word_corpus(tmp_path / "texts", docs=6, words_per_doc=400)
    finished = []
    real = ShardWriter._finish

    def stop_after_two(self):
        if len(finished) == 2:
            raise KeyboardInterrupt
        finished.append(1)
        real(self)
    monkeypatch.setattr(ShardWriter, "_finish", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        tokenize_corpus(texts, tmp_path / "tok", vocab_size=VOCAB, shard_size=200, progress=False)
    left = sorted(p.name for p in (tmp_path / "tok").iterdir())
    assert "index.json" not in left and left[:2] == ["train-000000.bin", "train-000001.bin"]
    assert all((tmp_path / "tok" / n).stat().st_size == 400 for n in left if n.endswith(".bin"))  # full shards only
    with pytest.raises(ValueError, match="has no index.json: not a token folder"):
        prepare_data(VOCAB, str(tmp_path / "tok"), 0)
    monkeypatch.setattr(ShardWriter, "_finish", real)
    tokenize_corpus(texts, tmp_path / "tok", vocab_size=VOCAB, shard_size=200, progress=False)  # a rerun cleans up
    assert np.array_equal(np.asarray(open_token_folder(tmp_path / "tok").train),
                          reference_split(load_tokenizer(tmp_path / "tok"), texts)[0])
    assert not list((tmp_path / "tok").glob("*.tmp"))


def test_uint32_shards_for_a_large_vocabulary(tmp_path):
    assert (dtype_for(65536), dtype_for(65537), dtype_for(151552)) == ("uint16", "uint32", "uint32")
    ids = np.array([0, 65535, 65536, 151551], dtype=np.int64)
    w = ShardWriter(tmp_path, "val", "uint32", 3)
    w.append(ids)
    shards = w.close()
    t = ShardedTokens([tmp_path / s["file"] for s in shards], [s["tokens"] for s in shards], "uint32")
    assert np.array_equal(t[0:4], ids) and (tmp_path / "val-000001.bin").stat().st_size == 4


def test_cli_tokenize_and_its_refusals(tmp_path, capsys):
    texts = write_word_corpus(tmp_path / "texts", docs=5, words_per_doc=200)
    out = tmp_path / "tok"
    assert main(["tokenize", str(texts), "--out", str(out), "--vocab-size", str(VOCAB), "--shard-size", "500",
                 "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert f"train with: glm5lab train --data {out}" in said and "uint16" in said
    assert json.loads((out / "index.json").read_text())["tokenizer_sha256"]
    assert load_tokenizer(out).get_vocab_size() <= VOCAB
    for argv, message in [
        (["--out", str(out)], "holds a token folder already (index.json)"),
        (["--out", str(texts)], "holds other files (doc0.txt"),
        (["--out", str(tmp_path / "x"), "--shard-size", "0"], "--shard-size = 0 is not allowed: an integer >= 1"),
    ]:
        assert main(["tokenize", str(texts), *argv, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("glm5lab tokenize: error: ") and message in err and err.count("\n") == 1


def test_parquet_without_datasets_names_the_extra(tmp_path, monkeypatch, capsys):
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # import datasets -> ImportError
    assert main(["tokenize", str(tmp_path / "a.parquet"), "--out", str(tmp_path / "tok"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "needs the `datasets` library: pip install -e .[data]" in err and err.count("\n") == 1


def test_the_tokenizer_trained_in_pieces_is_the_one_trained_on_whole_texts(tmp_path, monkeypatch):
    """`cached_tokenizer` feeds the trainer pieces (here of at most 64 characters): the tokenizer `train_tokenizer`
    gives on the whole texts, byte for byte, under the cache key of the texts."""
    from glm5lab.data import pieces
    from glm5lab.data.tokenizer import cached_tokenizer

    docs = list(open_corpus(write_word_corpus(tmp_path / "texts", docs=4, words_per_doc=300)).documents())
    whole = train_tokenizer([d.text for d in docs], VOCAB, tmp_path / "whole")
    monkeypatch.setattr(pieces, "PIECE_CHARS", 64)
    assert cached_tokenizer(lambda: iter(docs), VOCAB, tmp_path / "cache").to_str() == whole.to_str()


def test_a_tokenizer_without_endoftext_is_refused(tmp_path):
    texts = write_word_corpus(tmp_path / "texts", docs=3, words_per_doc=50)
    spec = json.loads(train_tokenizer(["the king and the sea"] * 20, VOCAB, tmp_path / "tk").to_str())
    spec["added_tokens"] = []
    spec["model"]["vocab"].pop("<|endoftext|>")
    (tmp_path / "no-eot.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"no <\|endoftext\|> token, needed as the document separator"):
        tokenize_corpus(texts, tmp_path / "tok", tokenizer=tmp_path / "no-eot.json", vocab_size=VOCAB, progress=False)


class _Spy:
    """A tokenizer that records the longest text it was asked to encode."""

    def __init__(self, tok):
        self._tok, self.longest = tok, 0

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode_batch_fast(self, texts, **kw):
        self.longest = max(self.longest, *map(len, texts))
        return self._tok.encode_batch_fast(texts, **kw)


def _long_text(words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    atoms = ["the", "king", "sea,", "fool.", "it's", "\n", "\n\n", "   ", "\u4e2d\u6587\u3002", "caf\u00e9", "1234",
             "<|endoftext|>", "\t", "!?"]
    return " ".join(rng.choice(atoms) for _ in range(words))


@pytest.mark.parametrize("words", [3000, 12000])
def test_a_long_document_is_encoded_in_pieces_to_the_whole_documents_tokens(tmp_path, monkeypatch, words):
    """Issue 36: a text file is read in chunks and encoded in pieces of at most PIECE_CHARS characters (here 500),
    whatever its length, and the shards hold exactly the tokens of the whole document: a one-document corpus (its
    text split inside) and a folder with a long document beside short ones."""
    from glm5lab.data import pieces, sources, tokenize

    for module in (pieces, tokenize):
        monkeypatch.setattr(module, "PIECE_CHARS", 500)
    monkeypatch.setattr(sources, "READ_BYTES", 4096)
    one = tmp_path / "one.txt"
    one.write_text(_long_text(words))
    folder = write_word_corpus(tmp_path / "folder", docs=6, words_per_doc=50)
    (folder / "long.txt").write_text(_long_text(words, seed=1))
    tok = train_tokenizer([_long_text(2000, seed=2)], VOCAB, tmp_path / "tk")
    for data in (one, folder):
        spy = _Spy(tok)
        monkeypatch.setattr(tokenize, "load_tokenizer", lambda path: spy)
        out = tmp_path / f"tok-{data.name}"
        index = tokenize_corpus(data, out, tokenizer=tmp_path / "tk", vocab_size=VOCAB, progress=False)
        train_ids, val_ids = reference_split(tok, data)
        tokens = open_token_folder(out)
        assert np.array_equal(np.asarray(tokens.train), train_ids) and np.array_equal(np.asarray(tokens.val), val_ids)
        assert 400 < spy.longest <= 500 < len(data.read_text() if data.is_file() else (folder / "long.txt").read_text())
        assert index["encoding"].startswith("pieces of at most 500 characters")
    assert index["splits"]["train"]["documents"] + index["splits"]["val"]["documents"] == 7


def test_a_tokenizer_that_cannot_be_cut_is_encoded_whole_and_said_so(tmp_path, monkeypatch, capsys):
    from glm5lab.data import pieces, tokenize

    for module in (pieces, tokenize):
        monkeypatch.setattr(module, "PIECE_CHARS", 500)
    (tmp_path / "one.txt").write_text(_long_text(2000))
    tok = train_tokenizer([_long_text(2000, seed=2)], VOCAB, tmp_path / "tk")
    spec = json.loads(tok.to_str())
    spec["normalizer"] = {"type": "NFC"}
    (tmp_path / "nfc.json").write_text(json.dumps(spec))
    index = tokenize_corpus(tmp_path / "one.txt", tmp_path / "tok", tokenizer=tmp_path / "nfc.json", vocab_size=VOCAB,
                            progress=False)
    train_ids, val_ids = reference_split(load_tokenizer(tmp_path / "nfc.json"), tmp_path / "one.txt")
    tokens = open_token_folder(tmp_path / "tok")
    assert np.array_equal(np.asarray(tokens.train), train_ids) and np.array_equal(np.asarray(tokens.val), val_ids)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"glm5lab tokenize: --tokenizer {tmp_path / 'nfc.json'}: its "
                                                   "normalizer (NFC) may join characters across a cut, so each "
                                                   "document is encoded whole")
    assert index["encoding"] == "whole documents (its normalizer (NFC) may join characters across a cut)"


@pytest.mark.slow
def test_peak_memory_does_not_follow_the_document(tmp_path):
    """Issue 36, measured: fresh processes tokenizing one document of 4 MB and of 24 MB peak within 60 MB of each
    other and under 600 MB (encoded whole, 24 MB took ~3 GB: BENCHMARKS.md)."""
    import subprocess
    import sys
    from pathlib import Path

    if not Path("/proc/self/status").is_file():
        pytest.skip("reads VmHWM from /proc (Linux)")
    train_tokenizer([_long_text(3000, seed=2)], VOCAB, tmp_path / "tk")
    unit, peaks = _long_text(20000), []
    code = ("import sys; from glm5lab.data.tokenize import tokenize_corpus; tokenize_corpus(sys.argv[1], sys.argv[2], "
            "tokenizer=sys.argv[3], vocab_size=300, progress=False); "
            "print([line for line in open('/proc/self/status') if line.startswith('VmHWM')][0].split()[1])")
    for mb in (4, 24):
        doc = tmp_path / f"doc{mb}.txt"
        doc.write_text((unit * (mb * 10**6 // len(unit) + 1))[:mb * 10**6])
        r = subprocess.run([sys.executable, "-c", code, str(doc), str(tmp_path / f"tok{mb}"), str(tmp_path / "tk")],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        peaks.append(int(r.stdout.split()[-1]) / 1024)
    assert peaks[1] < 600 and peaks[1] - peaks[0] < 60, peaks
