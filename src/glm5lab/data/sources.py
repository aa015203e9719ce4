"""The one corpus reader: the documents of a file or folder, streamed one at a time, for `glm5lab tokenize` and the
token folder `glm5lab train --data` caches for a text corpus (`glm5lab.data.tokenize`).

What is read (`SUFFIXES`): a .txt/.md file is one document (UTF-8, a leading BOM dropped, newlines normalised to
"\\n", as `Path.read_text` gives it); a .jsonl file one per non-blank line (string field `text_field`), named
`FILE:LINE` (LINE counted from 1 over every line, blank ones included); a .parquet/.arrow file one per row
(column `text_field`, read with the `datasets` library in streaming mode), named `FILE:ROW` (ROW from 0); a folder
every such file inside, recursively, in sorted path order, FILE relative to the folder, but for hidden ones (a
name starting with "." at any depth: .git/, .cache/, .DS_Store, ...). A document's name, and with it its side of
the train/validation split, never depends on the other files.

Skipped, not an error: in a folder, files of other types, hidden files and folders, and empty files (blank: nothing
but whitespace; a table: no rows), named in one line on stderr with the number of files read (`_say_skipped`);
blank lines in a JSONL file.
Refused (ValueError, one line naming the file, line or row): an unknown file type given as DATA (the message lists
`SUFFIXES`), a folder without such files or with only empty ones, an empty file given as DATA, bad UTF-8, a table
file that cannot be read, a JSONL line that is not an object with a non-blank string field, a table row without
non-blank string text, a table without the column (the message names `glm5lab tokenize --text-field`).

`open_corpus` lists the files once (the notices are said once); `Corpus.documents()` reads them, again on each
call (tokenize reads a corpus two to four times). A text file comes as a `TextFile`, read in chunks on demand, so
a document of any size is never held whole.
A JSONL line or a table row is parsed whole: its document is always held in memory (docs/data.md, "Long
documents").
"""

from __future__ import annotations

import codecs
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from glm5lab.console import say
from glm5lab.data.corpus import Document

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
    flag: str = "--data"
    """The option that named the corpus, for the hints of its errors: --data (training), else a held-out set's
    (`glm5lab train --val-data`, `glm5lab eval perplexity`'s PATH)."""

    def documents(self) -> Iterator[Document | TextFile]:
        """Yield the documents in order (reading the files again on each call); text files as `TextFile`s. Raises
        ValueError as the module says."""
        for path, name in self.files:
            yield from _file_documents(path, name, self)


def open_corpus(path, text_field: str = "text", flag: str = "--data") -> Corpus:
    """List the corpus at `path` (a file or a folder, see the module docstring): files of other types, hidden and
    empty files in a folder are skipped, named in one line on stderr. Raises FileNotFoundError for a missing
    path; ValueError for an unknown file type, an empty file given as the corpus, bad UTF-8 or an unreadable table
    (found while checking for empty files), or a folder without a non-empty file of `SUFFIXES`. flag: the option
    naming `path`, for the hints of later errors (`Corpus.flag`)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no corpus at {path}: expected a file or a folder of {'/'.join(SUFFIXES)} files")
    if path.is_dir():
        return Corpus(path, tuple((f, f.relative_to(path).as_posix()) for f in _folder_files(path)), text_field, flag)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; allowed: {', '.join(SUFFIXES)}")
    if _empty(path):
        what = {".jsonl": "expected one JSON object per line", ".parquet": "the table has no rows",
                ".arrow": "the table has no rows"}.get(suffix, "every document must hold some text")
        raise ValueError(f"{path} is empty: {what}")
    return Corpus(path, ((path, path.name),), text_field, flag)


def _folder_files(folder: Path) -> list[Path]:
    every, hidden = _walk(folder)
    files = [p for p in every if p.suffix.lower() in SUFFIXES]
    if not files:
        raise ValueError(f"folder {folder} holds no {'/'.join(SUFFIXES)} files (searched recursively; names "
                         "starting with '.' skipped)")
    empty = [p for p in files if _empty(p)]  # in sorted order, like `files`
    if len(empty) == len(files):
        raise ValueError(f"folder {folder}: its {len(files)} {'/'.join(SUFFIXES)} file{'s' * (len(files) > 1)} "
                         "hold no text (empty or whitespace only, or a table without rows)")
    skip = set(empty)
    read = [p for p in files if p not in skip]
    rel = lambda paths: [p.relative_to(folder).as_posix() for p in paths]  # noqa: E731
    _say_skipped(folder, len(read), [("empty file", rel(empty)),
                                     ("other file", rel(p for p in every if p.suffix.lower() not in SUFFIXES)),
                                     ("hidden file or folder (name starting with '.')", hidden)])
    return read


def _walk(folder: Path) -> tuple[list[Path], list[str]]:
    """(the files under `folder`, recursively, in sorted path order, but for hidden ones; the hidden files and
    folders met, relative to `folder`, a folder with a trailing "/", its contents not listed). Symbolic links to
    folders are not followed (as `Path.rglob`)."""
    files, hidden = [], []
    for root, dirs, names in os.walk(folder):
        here = Path(root)
        hidden += [(here / d).relative_to(folder).as_posix() + "/" for d in dirs if d.startswith(".")]
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if (here / name).is_file():
                if name.startswith("."):
                    hidden.append((here / name).relative_to(folder).as_posix())
                else:
                    files.append(here / name)
    return sorted(files), sorted(hidden)


def _say_skipped(folder: Path, n_read: int, skipped: list[tuple[str, list[str]]]) -> None:
    """One line on stderr when a folder's listing skips anything: the number of files read, then each kind of
    file skipped, with its count and up to 5 names."""
    parts = []
    for what, names in skipped:
        if names:
            shown = ", ".join(names[:5]) + (f", ... ({len(names) - 5} more)" if len(names) > 5 else "")
            plural = what.replace("file", "files").replace("folder", "folders") if len(names) > 1 else what
            parts.append(f"{len(names)} {plural}: {shown}")
    if parts:
        say(f"glm5lab: corpus folder {folder}: reading its {n_read} {'/'.join(SUFFIXES)} file"
            f"{'s' * (n_read > 1)}; skipping {'; '.join(parts)}")


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


def _empty(path: Path) -> bool:
    """True when `path` holds no document: a text or JSONL file empty or whitespace only (read until its first
    other character), a table file without rows (`_table_empty`)."""
    if path.suffix.lower() in TABLE_SUFFIXES:
        return _table_empty(path)
    return all(not chunk.strip() for chunk in _decoded(path, _BLANK_CHECK_BYTES))


def _table_empty(path: Path) -> bool:
    """True when the parquet / arrow file at `path` has no rows: parquet's footer, an arrow stream's (or file's)
    batches up to the first with rows, memory-mapped. Raises ValueError naming the file when it cannot be read
    as one (or when `datasets` is not installed, `_datasets`)."""
    _datasets(path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix.lower() == ".parquet":
            return pq.ParquetFile(path).metadata.num_rows == 0
        with pa.memory_map(str(path)) as source:
            try:  # the two arrow layouts, as the `datasets` arrow builder opens them
                return not any(batch.num_rows for batch in pa.ipc.open_stream(source))
            except (OSError, pa.ArrowInvalid):
                source.seek(0)
                reader = pa.ipc.open_file(source)
                return not any(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path}: not a readable {path.suffix.lower()[1:]} file ({e})") from None


def _file_documents(path: Path, name: str, corpus: Corpus) -> Iterator[Document | TextFile]:
    suffix = path.suffix.lower()
    if suffix in TABLE_SUFFIXES:
        yield from _table_documents(path, name, corpus)
    elif suffix == ".jsonl":
        yield from _jsonl_documents(path, name, corpus)
    else:
        yield TextFile(name, path)


def _jsonl_documents(path: Path, name: str, corpus: Corpus) -> Iterator[Document]:
    """One document per non-blank line; lines as `str.splitlines` cuts them (each physical line is cut again, so
    U+2028 and the other separators it knows split lines too), numbered from 1, blank lines counted."""
    lineno = 0
    try:
        with open(path, encoding="utf-8-sig") as f:
            for physical in f:
                for line in physical.splitlines():
                    lineno += 1
                    if line.strip():
                        yield Document(f"{name}:{lineno}", _jsonl_text(line, path, lineno, corpus))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid UTF-8 ({e}); corpus files must be UTF-8 text") from None


def _jsonl_text(line: str, path: Path, lineno: int, corpus: Corpus) -> str:
    field = corpus.text_field
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {lineno}: not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}, line {lineno}: expected a JSON object with a non-blank string field '{field}', "
                         f"got {_a(record)}")
    if field not in record:
        raise ValueError(f"{path}, line {lineno} has no field {field!r} (its fields: "
                         f"{', '.join(record) or 'none'}){_field_hint(corpus, 'field')}")
    return _checked_text(record[field], f"{path}, line {lineno}: field {field!r}")


def _field_hint(corpus: Corpus, what: str) -> str:
    """How to read another JSONL field / table column (only `glm5lab tokenize` has --text-field): nothing when one
    was named already; for a held-out set (`Corpus.flag` other than --data), that it reads 'text' only."""
    if corpus.text_field != "text":
        return ""
    if corpus.flag != "--data":
        return (f"; {corpus.flag} reads the {what} 'text': write the set with its text under that name (a token "
                f"folder of `glm5lab tokenize --text-field NAME --tokenizer RUN/model` is scored on its validation "
                "split only)")
    return (f"; name the text {what} with `glm5lab tokenize {corpus.path} --text-field NAME --out DIR` (then "
            "`glm5lab train --data DIR`)")


def _checked_text(value, where: str) -> str:
    """`value` when it is a string with some non-whitespace character; else ValueError '`where` ...' saying what it
    holds."""
    if isinstance(value, str) and value.strip():
        return value
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where} holds {_a(value)}, not a string")
    what = "is null" if value is None else "is empty" if not value else "is blank (whitespace only)"
    raise ValueError(f"{where} {what}: every document must be a non-blank string")


def _a(value) -> str:
    """'a list ([1, 2])', 'an int (3)': a value's type and its repr (cut to 40 characters)."""
    kind = type(value).__name__
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({shown})"


def _table_documents(path: Path, name: str, corpus: Corpus) -> Iterator[Document]:
    field = corpus.text_field
    dataset = _stream_table(path)
    columns = _columns(dataset)
    if field not in columns:
        raise ValueError(f"{path} has no column {field!r} (its columns: {', '.join(columns) or 'none'})"
                         f"{_field_hint(corpus, 'column')}")
    batches, row = iter(dataset.select_columns([field]).iter(batch_size=_ROWS_PER_READ)), 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:  # pyarrow's and datasets' errors for a damaged file
            raise ValueError(f"{path}, from row {row}: not a readable {path.suffix.lower()[1:]} file "
                             f"({type(e).__name__}: {e})") from None
        for text in batch[field]:
            yield Document(f"{name}:{row}", _checked_text(text, f"{path}, row {row}: column {field!r}"))
            row += 1


def _datasets(path: Path):
    """The `datasets` module (it brings pyarrow); ValueError naming the extra when it is not installed."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"reading {path.suffix} files ({path}) needs the `datasets` library: "
                         "pip install -e .[data]") from None
    return datasets


def _stream_table(path: Path):
    datasets = _datasets(path)
    builder = "parquet" if path.suffix.lower() == ".parquet" else "arrow"
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets.load_dataset(builder, data_files=[str(path)], split="train", streaming=True)


def _columns(dataset) -> list[str]:
    if dataset.features is not None:
        return list(dataset.features)
    first = next(iter(dataset), None)
    return list(first) if first is not None else []
