"""Documents of a corpus, streamed one at a time: what `glm5lab tokenize` reads.

The text formats are those of `glm5lab.train.corpus.load_documents` with the same document names, texts,
order and refusals (a test pins `list(iter_documents(p)) == load_documents(p)`), but a JSONL file is read
line by line instead of whole. Added: parquet and arrow files (and folders holding them), read with the
`datasets` library in streaming mode, one document per row, named `FILE:ROW` (ROW counted from 0 within
the file; FILE relative to the folder, or the file's name), so a document's name, and with it its side of
the train/validation split, never depends on the other files. `datasets` is the optional extra `data`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from glm5lab.train.corpus import SUFFIXES, Document, _load_file, corpus_files

TABLE_SUFFIXES = (".parquet", ".arrow")
ALL_SUFFIXES = SUFFIXES + TABLE_SUFFIXES
_ROWS_PER_READ = 1000


def iter_documents(path, text_field: str = "text") -> Iterator[Document]:
    """Yield the documents of `path` in order: a .txt/.md file (one document), a .jsonl file (one per line,
    string field `text_field`), a .parquet/.arrow file (one per row, column `text_field`), or a folder (every
    such file inside, recursively, in sorted path order, names relative to the folder; other files are named
    in one line on stderr and skipped). Raises FileNotFoundError for a missing path; ValueError as
    `load_documents` (unsupported suffix, empty folder, bad UTF-8, empty document, bad JSONL line), for a
    table without the `text_field` column (naming the columns it has) or with an empty row, and a one-line
    ImportError naming `pip install -e .[data]` for a table without `datasets` installed."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no corpus at {path}: expected a file or a folder of {'/'.join(ALL_SUFFIXES)} files")
    if path.is_file():
        yield from _file_documents(path, path.name, text_field)
        return
    for f in corpus_files(path, ALL_SUFFIXES):
        yield from _file_documents(f, f.relative_to(path).as_posix(), text_field)


def _file_documents(path: Path, name: str, text_field: str) -> Iterator[Document]:
    suffix = path.suffix.lower()
    if suffix in TABLE_SUFFIXES:
        yield from _table_documents(path, name, text_field)
    elif suffix == ".jsonl":
        yield from _jsonl_documents(path, name, text_field)
    else:
        yield from _load_file(path, name)


def _jsonl_documents(path: Path, name: str, text_field: str) -> Iterator[Document]:
    """`corpus._parse_jsonl` line by line: lines as `str.splitlines` cuts them (each physical line is cut again,
    so U+2028 and the other separators it knows split as they do there), numbered from 1."""
    lineno = 0
    try:
        with open(path, encoding="utf-8-sig") as f:
            for physical in f:
                for line in physical.splitlines():
                    lineno += 1
                    yield Document(f"{name}:{lineno}", _jsonl_text(line, path, lineno, text_field))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid UTF-8 ({e}); corpus files must be UTF-8 text") from e
    if lineno == 0:
        raise ValueError(f"{path} is empty: expected one JSON object per line")


def _jsonl_text(line: str, path: Path, lineno: int, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {lineno}: not valid JSON ({e})") from e
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
        raise ImportError(f"reading {path.suffix} files needs the `datasets` library: pip install -e .[data]") from None
    builder = "parquet" if path.suffix.lower() == ".parquet" else "arrow"
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets.load_dataset(builder, data_files=[str(path)], split="train", streaming=True)


def _columns(dataset) -> list[str]:
    if dataset.features is not None:
        return list(dataset.features)
    first = next(iter(dataset), None)
    return list(first) if first is not None else []
