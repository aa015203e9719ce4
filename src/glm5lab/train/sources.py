"""The one corpus reader: the documents of a file or folder, streamed one at a time, for `glm5lab train --data`
(which holds them in memory) and `glm5lab tokenize` (which does not).

What is read (`SUFFIXES`): a .txt/.md file is one document (UTF-8, a leading BOM dropped, newlines normalised to
"\\n", as `Path.read_text` gives it); a .jsonl file one per non-blank line (string field `text_field`), named
`FILE:LINE` (LINE counted from 1 over every line, blank ones included); a .parquet/.arrow file one per row
(column `text_field`, read with the `datasets` library in streaming mode), named `FILE:ROW` (ROW from 0); a folder
every such file inside, recursively, in sorted path order, FILE relative to the folder. A document's name, and
with it its side of the train/validation split, never depends on the other files.

Not an error: files of other types in a folder (named in one line on stderr and skipped), blank lines in a JSONL
file (skipped), an empty file in a folder (blank: nothing but whitespace; named in one line and skipped).
Refused (ValueError, one line naming the file, line or row): an unknown file type given as DATA (the message lists
`SUFFIXES`), a folder without such files or with only empty ones, an empty file given as DATA, bad UTF-8, a JSONL
line that is not an object with a non-empty string field, a table row without text, a table without the column.

`open_corpus` lists the files once (the notices are said once); `Corpus.documents()` reads them, again on each
call (tokenize reads a corpus two to four times). With `lazy=True` a text file comes as a `TextFile`, read in
chunks on demand, so a document of any size is never held whole; otherwise as a `Document` holding its text.
"""

from __future__ import annotations

import codecs
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from glm5lab.console import say
from glm5lab.train.corpus import Document

TEXT_SUFFIXES = (".txt", ".md")
TABLE_SUFFIXES = (".parquet", ".arrow")
SUFFIXES = (".txt", ".md", ".jsonl", *TABLE_SUFFIXES)
READ_BYTES = 1 << 20  # bytes per read of a text file: chunks of at most ~1 M characters
_BLANK_CHECK_BYTES = 1 << 16
_ROWS_PER_READ = 1000


@dataclass(frozen=True)
class TextFile:
    """A text file's document, read on demand: characters [start, stop) (None: to the end) of the file's text,
    decoded exactly as `Path.read_text(encoding="utf-8-sig")` decodes it. The interface of `Document`: `name`,
    `text` (read whole), `chunks()`, `part(name, start, stop)`. Reading raises ValueError for bad UTF-8."""

    name: str
    path: Path
    start: int = 0
    stop: int | None = None

    @property
    def text(self) -> str:
        return "".join(self.chunks())

    def chunks(self) -> Iterator[str]:
        """The text in consecutive pieces of at most `READ_BYTES` characters (one read each)."""
        skip, left = self.start, None if self.stop is None else self.stop - self.start
        for chunk in _decoded(self.path, READ_BYTES):
            if skip:
                chunk, skip = chunk[skip:], max(0, skip - len(chunk))
            if left is not None:
                chunk, left = chunk[:left], left - min(left, len(chunk))
            if chunk:
                yield chunk
            if left == 0:
                return

    def part(self, name: str, start: int, stop: int) -> TextFile:
        """Characters [start, stop) of this document, as a document named `name` (still read on demand)."""
        return TextFile(name, self.path, self.start + start, self.start + stop)


@dataclass(frozen=True)
class Corpus:
    """A corpus's files, listed once (`open_corpus`): (path, name) pairs in reading order."""

    path: Path
    files: tuple[tuple[Path, str], ...]
    text_field: str = "text"

    def documents(self, lazy: bool = False) -> Iterator[Document | TextFile]:
        """Yield the documents in order (reading the files again on each call); text files as `TextFile`s when
        `lazy`, else as `Document`s. Raises ValueError / ImportError as the module says."""
        for path, name in self.files:
            yield from _file_documents(path, name, self.text_field, lazy)


def open_corpus(path, text_field: str = "text") -> Corpus:
    """List the corpus at `path` (a file or a folder, see the module docstring): files of other types and empty
    files in a folder are named in one line each on stderr and skipped. Raises FileNotFoundError for a missing
    path; ValueError for an unknown file type, an empty file given as the corpus, bad UTF-8 (found while checking
    for empty files), or a folder without a non-empty file of `SUFFIXES`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no corpus at {path}: expected a file or a folder of {'/'.join(SUFFIXES)} files")
    if path.is_dir():
        return Corpus(path, tuple((f, f.relative_to(path).as_posix()) for f in _folder_files(path)), text_field)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; allowed: {', '.join(SUFFIXES)}")
    if suffix not in TABLE_SUFFIXES and _blank(path):
        what = "expected one JSON object per line" if suffix == ".jsonl" else "every document must hold some text"
        raise ValueError(f"{path} is empty: {what}")
    return Corpus(path, ((path, path.name),), text_field)


def iter_documents(path, text_field: str = "text", *, lazy: bool = False) -> Iterator[Document | TextFile]:
    """`open_corpus(path, text_field).documents(lazy)`: the corpus's documents in order (errors as both say)."""
    yield from open_corpus(path, text_field).documents(lazy)


def _folder_files(folder: Path) -> list[Path]:
    every = sorted(p for p in folder.rglob("*") if p.is_file())
    files = [p for p in every if p.suffix.lower() in SUFFIXES]
    if not files:
        raise ValueError(f"folder {folder} holds no {'/'.join(SUFFIXES)} files (searched recursively)")
    _say_skipped(folder, f"reading its {len(files)} {'/'.join(SUFFIXES)} files; skipping", "other file",
                 [p for p in every if p.suffix.lower() not in SUFFIXES])
    empty = {p for p in files if p.suffix.lower() not in TABLE_SUFFIXES and _blank(p)}
    if len(empty) == len(files):
        raise ValueError(f"folder {folder}: its {len(files)} {'/'.join(SUFFIXES)} file{'s' * (len(files) > 1)} "
                         "hold no text (empty or whitespace only)")
    _say_skipped(folder, "skipping", "empty file", sorted(empty))
    return [p for p in files if p not in empty]


def _say_skipped(folder: Path, lead: str, what: str, skipped: list[Path]) -> None:
    if not skipped:
        return
    names = [p.relative_to(folder).as_posix() for p in skipped]
    shown = ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")
    say(f"glm5lab: corpus folder {folder}: {lead} {len(names)} {what}{'s' * (len(names) > 1)}: {shown}")


def _decoded(path: Path, block: int) -> Iterator[str]:
    """The text of `path` as `Path.read_text(encoding="utf-8-sig")` gives it (BOM dropped, universal newlines:
    the decoder `open()` stacks), decoded `block` bytes at a time. Raises ValueError for bad UTF-8."""
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8-sig")(), translate=True)
    offset = 0
    with open(path, "rb") as f:
        while True:
            data = f.read(block)
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} is not valid UTF-8 ({e.reason} near byte {offset + e.start:,}); corpus "
                                 "files must be UTF-8 text") from None
            if text:
                yield text
            if not data:
                return
            offset += len(data)


def _blank(path: Path) -> bool:
    """True when the text of `path` is empty or whitespace only (read until its first other character)."""
    return all(not chunk.strip() for chunk in _decoded(path, _BLANK_CHECK_BYTES))


def _file_documents(path: Path, name: str, text_field: str, lazy: bool) -> Iterator[Document | TextFile]:
    suffix = path.suffix.lower()
    if suffix in TABLE_SUFFIXES:
        yield from _table_documents(path, name, text_field)
    elif suffix == ".jsonl":
        yield from _jsonl_documents(path, name, text_field)
    else:
        doc = TextFile(name, path)
        yield doc if lazy else Document(name, doc.text)


def _jsonl_documents(path: Path, name: str, text_field: str) -> Iterator[Document]:
    """One document per non-blank line; lines as `str.splitlines` cuts them (each physical line is cut again, so
    U+2028 and the other separators it knows split lines too), numbered from 1, blank lines counted."""
    lineno = 0
    try:
        with open(path, encoding="utf-8-sig") as f:
            for physical in f:
                for line in physical.splitlines():
                    lineno += 1
                    if line.strip():
                        yield Document(f"{name}:{lineno}", _jsonl_text(line, path, lineno, text_field))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid UTF-8 ({e}); corpus files must be UTF-8 text") from None


def _jsonl_text(line: str, path: Path, lineno: int, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {lineno}: not valid JSON ({e})") from None
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{path}, line {lineno}: expected a JSON object with a non-empty string field '{text_field}'")
    return text


def _table_documents(path: Path, name: str, text_field: str) -> Iterator[Document]:
    dataset = _stream_table(path)
    columns = _columns(dataset)
    if text_field not in columns:
        flag = "" if text_field != "text" else "; name the text column with --text-field NAME"
        raise ValueError(f"{path} has no column {text_field!r} (its columns: {', '.join(columns) or 'none'}){flag}")
    row = 0
    for batch in dataset.select_columns([text_field]).iter(batch_size=_ROWS_PER_READ):
        for text in batch[text_field]:
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{path}, row {row}: column {text_field!r} holds {text!r}: every document must "
                                 "hold some text")
            yield Document(f"{name}:{row}", text)
            row += 1


def _stream_table(path: Path):
    try:
        import datasets
    except ImportError:
        raise ValueError(f"reading {path.suffix} files ({path}) needs the `datasets` library: "
                         "pip install -e .[data]") from None
    builder = "parquet" if path.suffix.lower() == ".parquet" else "arrow"
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets.load_dataset(builder, data_files=[str(path)], split="train", streaming=True)


def _columns(dataset) -> list[str]:
    if dataset.features is not None:
        return list(dataset.features)
    first = next(iter(dataset), None)
    return list(first) if first is not None else []
