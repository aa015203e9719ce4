"""`glm5lab tokenize DATA --out DIR`: a corpus to a token folder (`glm5lab.data.shards`), streamed.

Documents are read (`glm5lab.data.sources.open_corpus`; a text file in chunks, never whole), cut into pieces
of at most `PIECE_CHARS` characters where the tokenizer's own pre-tokens end (`glm5lab.data.pieces`: the same
tokens as encoding the document whole), encoded a batch of pieces at a time and appended to the open shard of
their split, so memory grows neither with the corpus nor with its largest document. A tokenizer whose boundaries
`Cutter` does not know (`Cutter.of` says why, in one line once a document is longer than a piece) has its
documents encoded whole. The split is `glm5lab.data.corpus.SplitAssigner`'s, decided per document while
streaming; a pass that ends in one of its fallbacks is run again with it fixed (only tiny corpora; a corpus of text
files, named without reading them, is settled first, so one long file is encoded once).
Each split's stream is its documents' tokens in input order, `<|endoftext|>` between two documents (the one
place that joins them). Without `--tokenizer` the byte-level BPE is trained on the training split at
`vocab_size` and cached (`cached_tokenizer`, fed pieces). `glm5lab train --data TEXT` trains from the token
folder `cached_token_folder` writes the same way into glm5lab's cache.

Atomicity: a shard is written as `NAME.tmp` and renamed when full; `tokenizer.json` then `index.json` last,
each atomically; a folder without `index.json` is not a token folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import glm5lab
from glm5lab.io_utils import atomic_write_text, publish_folder
from glm5lab.data.tokenizer import BPE_RECIPE, TOKENIZER_FILE, cached_tokenizer, eot_id, load_tokenizer
from glm5lab.data.corpus import VAL_FRACTION, SplitAssigner, cache_root, fetch_default_corpus, settled
from glm5lab.data.pieces import PIECE_CHARS, Cutter
from glm5lab.data.shards import FORMAT, INDEX_FILE, SPLITS, VERSION, dtype_for, shard_name, tokenizer_sha256
from glm5lab.data.sources import TEXT_SUFFIXES, open_corpus
from glm5lab.validate import int_at_least

DEFAULT_SHARD_SIZE = 100_000_000  # tokens per shard: 200 MB of uint16
BATCH_DOCS = 256  # pieces (documents, or parts of a long one) per encode_batch_fast call
BATCH_CHARS = 1 << 20  # ... or fewer, once their text passes 1 M characters (the batch's Encodings take ~100 B a token)
_OWN_FILE = re.compile(r"^(index\.json|tokenizer\.json|(train|val)-\d{6}\.bin(\.tmp)?|\.(index|tokenizer)\.json\..+\.tmp)$")


class ShardWriter:
    """Appends token ids of one split to shards of `shard_size` tokens in `folder`: the open shard is
    `NAME.tmp`, renamed to NAME once full (or at `close`). `shards` lists the finished ones."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_size: int):
        self.folder, self.split, self.dtype, self.shard_size = folder, split, np.dtype(dtype), shard_size
        self.shards: list[dict] = []
        self.documents = 0
        self._file, self._count = None, 0

    def append(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while ids.size:
            if self._file is None:
                self._file = open(self._tmp(len(self.shards)), "wb")
            take = min(ids.size, self.shard_size - self._count)
            self._file.write(ids[:take].tobytes())
            self._count += take
            ids = ids[take:]
            if self._count == self.shard_size:
                self._finish()

    def close(self) -> list[dict]:
        """Finish the open shard (a split with no tokens gets one empty shard); returns `shards`."""
        if self._file is not None or not self.shards:
            if self._file is None:
                self._file = open(self._tmp(len(self.shards)), "wb")
            self._finish()
        return self.shards

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self._count

    def _tmp(self, index: int) -> Path:
        return self.folder / f"{shard_name(self.split, index)}.tmp"

    def _finish(self) -> None:
        index = len(self.shards)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp(index), self.folder / shard_name(self.split, index))
        self.shards.append({"file": shard_name(self.split, index), "tokens": self._count})
        self._file, self._count = None, 0

    def abort(self) -> None:
        """Close and delete everything written (a pass run again starts from nothing)."""
        if self._file is not None:
            self._file.close()
            self._tmp(len(self.shards)).unlink(missing_ok=True)
        for s in self.shards:
            (self.folder / s["file"]).unlink(missing_ok=True)
        self.shards, self._file, self._count, self.documents = [], None, 0, 0


def tokenize_corpus(data, out, *, tokenizer=None, vocab_size: int, text_field: str = "text",
                    shard_size: int = DEFAULT_SHARD_SIZE, seed: int = 0, progress: bool = True) -> dict:
    """Write the token folder of corpus `data` (a path as `open_corpus` reads; None: the default Shakespeare
    corpus) into `out` (a new or empty folder, or one an interrupted run left without index.json) and return
    its index (also written to `out/index.json`). `tokenizer`: a tokenizer.json (or folder holding one); None:
    the byte-level BPE of `prepare_data`, trained on the training split at `vocab_size` and cached.
    Raises ValueError for a bad --shard-size, an --out that holds other files or a token folder already,
    and as `open_corpus` / `split_documents` for bad input; FileNotFoundError for a missing DATA or --tokenizer.
    On an error, an `out` this call created is removed with what it wrote (Ctrl-C leaves whole shards, no index)."""
    int_at_least("--shard-size", shard_size, 1)
    source = Path(data) if data else fetch_default_corpus()
    corpus = open_corpus(source, text_field)
    created = not Path(out).exists()
    out = _prepare_out(Path(out))
    try:
        tok = load_tokenizer(Path(tokenizer)) if tokenizer else None
        return _tokenize_into(out, corpus, tok, f"--tokenizer {tokenizer}", vocab_size=vocab_size,
                              shard_size=shard_size, seed=seed, progress=progress)
    except Exception:
        if created:  # a failed tokenize leaves no folder it made (an interrupted one leaves its whole shards)
            _remove_own(out)
        raise


def cached_token_folder(data, seed: int, *, tokenizer=None, vocab_size: int, say: Callable[[str], None]) -> Path:
    """The token folder of text corpus `data` (a path as `open_corpus` reads; None: the default corpus) split with
    `seed` and tokenized by `tokenizer` (a `tokenizers.Tokenizer`; None: the byte-level BPE trained on the training
    split at `vocab_size`, from the tokenizer cache), tokenized on first use into glm5lab's cache:
    `cache_root()/tokens/<corpus name>-<corpus_key>-<tokenizer>/`, <tokenizer> being `bpe<vocab_size>` (trained)
    or the first 16 hex digits of `tokenizer_sha256`. A given tokenizer also takes the folder of a trained one that
    is the same tokenizer (a run that continues a checkpoint keeps its run's folder). So a changed file, seed or
    tokenizer gets another folder; none is rewritten in place. A fill says so in one line through `say`, writes a
    temporary sibling and renames it into place (an interrupted fill leaves no folder under the final name).
    Errors as `tokenize_corpus`."""
    source = Path(data) if data else fetch_default_corpus()
    corpus = open_corpus(source)
    root, stem = cache_root() / "tokens", f"{source.resolve().name}-{corpus_key(corpus, seed)}"
    sha = tokenizer_sha256(tokenizer) if tokenizer is not None else None
    folder = root / f"{stem}-{sha[:16] if sha else f'bpe{vocab_size}'}"
    if (folder / INDEX_FILE).is_file():
        return folder
    for other in sorted(root.glob(f"{stem}-bpe*")) if sha else ():
        if (other / INDEX_FILE).is_file() and json.loads((other / INDEX_FILE).read_text())["tokenizer_sha256"] == sha:
            return other
    root.mkdir(parents=True, exist_ok=True)
    what = f"tokenizer {sha[:12]}" if sha else f"byte-level BPE, vocab_size {vocab_size}"
    say(f"tokenizing {source} (split seed {seed}, {what}) once into the cache: {folder}")

    def fill(staging: Path) -> None:
        staging.mkdir()
        _tokenize_into(staging, corpus, tokenizer, what, vocab_size=vocab_size, seed=seed, progress=False)

    publish_folder(folder, fill, done=lambda f: (f / INDEX_FILE).is_file())
    return folder


HELD_OUT = "held-out"
"""The split key of a held-out set's cached token folder (`cached_held_out_folder`): every document to val."""


def cached_held_out_folder(data, tokenizer, *, say: Callable[[str], None], flag: str = "--val-data") -> Path:
    """The token folder of a held-out text set `data` (a path as `open_corpus` reads: `glm5lab train --val-data`,
    `glm5lab eval perplexity`), tokenized whole by `tokenizer` (a `tokenizers.Tokenizer`: the run's) on first use
    into glm5lab's cache: `cache_root()/tokens/<name>-<corpus_key(corpus, HELD_OUT)>-<tokenizer sha256[:16]>/`.
    No split: every document goes to its val split, in input order, `<|endoftext|>` between two (the train split
    is empty). A fill says so in one line through `say` and is published as `cached_token_folder`'s. Errors as
    `open_corpus` (FileNotFoundError for a missing path, ValueError for an empty file or folder; their hints name
    `flag`, the option that gave `data`)."""
    source = Path(data)
    corpus = open_corpus(source, flag=flag)
    sha = tokenizer_sha256(tokenizer)
    folder = cache_root() / "tokens" / f"{source.resolve().name}-{corpus_key(corpus, HELD_OUT)}-{sha[:16]}"
    if (folder / INDEX_FILE).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    say(f"tokenizing the held-out set {source} (tokenizer {sha[:12]}, no split) once into the cache: {folder}")

    def fill(staging: Path) -> None:
        staging.mkdir()
        cutter, why = Cutter.of(tokenizer)
        n_ids = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        writers = {split: ShardWriter(staging, split, dtype_for(n_ids), DEFAULT_SHARD_SIZE) for split in SPLITS}
        pairs = ((doc, True) for doc in corpus.documents())
        _encode_into(tokenizer, _pieces(pairs, cutter, _WholeNote(f"tokenizer {sha[:12]}", why)), writers, False)
        encoding = (f"pieces of at most {PIECE_CHARS} characters (glm5lab.data.pieces)" if cutter
                    else f"whole documents ({why})")
        finish_folder(staging, tokenizer, writers, split={"by": "none", "all": "val"}, source=str(corpus.path),
                      text_field=corpus.text_field, tokenizer_source=f"given: sha256 {sha}", encoding=encoding)

    publish_folder(folder, fill, done=lambda f: (f / INDEX_FILE).is_file())
    return folder


def corpus_key(corpus, seed: int | str) -> str:
    """SHA-256 (16 hex digits) of what a cached token folder's tokens depend on but the tokenizer: the token format
    and BPE recipe versions, the split rule (`VAL_FRACTION`, `seed`; `HELD_OUT`: no split), the text field, and each
    file's name and bytes, in the corpus's (an `open_corpus`) order."""
    h = hashlib.sha256(f"glm5lab-tokens-{VERSION}:bpe-{BPE_RECIPE}:{VAL_FRACTION}:{seed}:{corpus.text_field}".encode())
    for path, name in corpus.files:
        h.update(f"\0{name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()[:16]


def _tokenize_into(out: Path, corpus, tok, name: str, *, vocab_size: int, shard_size: int = DEFAULT_SHARD_SIZE,
                   seed: int, progress: bool) -> dict:
    """Write the token folder of `corpus` (an `open_corpus`) into the ready folder `out`, split with `seed`,
    tokenized by `tok` (a `tokenizers.Tokenizer`, `name` saying which; None: the byte-level BPE at `vocab_size`,
    `_trained_tokenizer`). Returns the index."""
    docs = lambda: corpus.documents()  # noqa: E731
    assigner = SplitAssigner(seed)
    trained = tok is None
    tok = _trained_tokenizer(assigner, docs, vocab_size) if trained else tok
    cutter, why = Cutter.of(tok)
    n_ids = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    dtype = dtype_for(n_ids)
    writers = {split: ShardWriter(out, split, dtype, shard_size) for split in SPLITS}
    whole = _WholeNote(name, why)

    def write(pairs):
        for w in writers.values():
            w.abort()
        _encode_into(tok, _pieces(pairs, cutter, whole), writers, progress)

    if all(path.suffix.lower() in TEXT_SUFFIXES for path, _ in corpus.files):  # names alone: no file is read
        settled(assigner, docs, lambda pairs: sum(1 for _ in pairs))  # so one long file is not encoded twice
    settled(assigner, docs, write)
    encoding = (f"pieces of at most {PIECE_CHARS} characters, cut where the whole text's pre-tokens end "
                "(glm5lab.data.pieces)" if cutter else f"whole documents ({why})")
    return finish_folder(out, tok, writers, split=assigner.record(), source=str(corpus.path),
                         text_field=corpus.text_field, tokenizer_source=f"trained: byte-level BPE, vocab_size "
                         f"{vocab_size}" if trained else name.removeprefix("--tokenizer "), encoding=encoding)


def _remove_own(out: Path) -> None:
    """Remove what `glm5lab tokenize` wrote into `out` (the files `_OWN_FILE` names), then `out` if that empties it."""
    for p in out.iterdir():
        if _OWN_FILE.match(p.name):
            p.unlink(missing_ok=True)
    try:
        out.rmdir()
    except OSError:  # something else is in it: leave it
        pass


def finish_folder(out: Path, tok, writers: dict, **meta) -> dict:
    """Close the splits' `ShardWriter`s, then write `tokenizer.json` and, last, `index.json` (each atomically)
    into `out`; `meta` (split rule, source, ...) goes into the index as is. Returns the index."""
    splits = {}
    for split, w in writers.items():
        w.close()
        splits[split] = {"documents": w.documents, "tokens": w.tokens, "shards": w.shards}
    some = next(iter(writers.values()))
    index = {"format": FORMAT, "version": VERSION, "dtype": some.dtype.name, "vocab_size": tok.get_vocab_size(),
             "tokenizer_sha256": tokenizer_sha256(tok), "shard_size": some.shard_size, "splits": splits, **meta,
             "glm5lab_version": glm5lab.__version__}
    atomic_write_text(out / TOKENIZER_FILE, tok.to_str())
    atomic_write_text(out / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    return index


def _trained_tokenizer(assigner: SplitAssigner, docs, vocab_size: int):
    """`cached_tokenizer` on the training split's documents, streamed (the split settled first)."""
    settled(assigner, docs, lambda pairs: sum(1 for _ in pairs))
    train_docs = lambda: (d for d, is_val in assigner.sides(docs()) if not is_val)  # noqa: E731
    return cached_tokenizer(train_docs, vocab_size, cache_root() / "tokenizers")


@dataclass
class _WholeNote:
    """Says once, on stderr, that documents are encoded whole (the tokenizer cannot be cut: `why`), when the
    first document longer than a piece comes."""

    tokenizer: str
    why: str | None
    said: bool = False

    def text(self, doc) -> str:
        text = doc.text
        if len(text) > PIECE_CHARS and not self.said:
            self.said = True
            print(f"glm5lab tokenize: {self.tokenizer}: {self.why}, so each document is encoded whole: memory grows "
                  f"with the largest document ({doc.name}: {len(text):,} characters); docs/data.md names the "
                  "tokenizers read in pieces", file=sys.stderr, flush=True)
        return text


def _pieces(pairs, cutter: Cutter | None, whole: _WholeNote) -> Iterator[tuple[bool, bool, str]]:
    """(is_val, whether it starts its document, text) of the pieces of (document, is_val) pairs, in order: a
    document's `cutter.pieces` of its chunks, or its whole text when there is no cutter."""
    for doc, is_val in pairs:
        for k, piece in enumerate(cutter.pieces(doc.chunks()) if cutter else (whole.text(doc),)):
            yield is_val, k == 0, piece


def _encode_into(tok, pieces, writers: dict, progress: bool) -> None:
    """Encode (is_val, starts a document, text) pieces a batch at a time and append each to its split's writer,
    `<|endoftext|>` before every document but the first of its split: the documents joined."""
    from tqdm import tqdm

    sep = np.array([eot_id(tok)], dtype=np.int64)
    bar = tqdm(unit="tok", unit_scale=True, disable=not progress, dynamic_ncols=True, desc="tokenize")
    start, chars = time.perf_counter(), 0
    try:
        for batch in piece_batches(pieces):
            encs = tok.encode_batch_fast([text for _, _, text in batch], add_special_tokens=False)
            for split in SPLITS:
                parts, w = [], writers[split]
                for (is_val, first, _), enc in zip(batch, encs):
                    if is_val == (split == "val"):
                        if first:
                            parts += [sep] if w.documents else []
                            w.documents += 1
                        parts.append(np.asarray(enc.ids, dtype=np.int64))
                if parts:
                    ids = np.concatenate(parts)
                    w.append(ids)
                    bar.update(ids.size)
            chars += sum(len(text) for _, _, text in batch)
            bar.set_postfix_str(f"{sum(w.documents for w in writers.values()):,} docs, "
                                f"{chars / 1e6 / max(time.perf_counter() - start, 1e-9):.1f} M chars/s", refresh=False)
    finally:
        bar.close()


def piece_batches(pieces) -> Iterator[list]:
    """Lists of consecutive (is_val, starts a document, text) pieces, each `BATCH_DOCS` long or past `BATCH_CHARS`
    characters (the last: what is left): what one `encode_batch_fast` call encodes."""
    batch, chars = [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[2])
        if len(batch) == BATCH_DOCS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _prepare_out(out: Path) -> Path:
    """`out`, created; files an interrupted `glm5lab tokenize` left (shards, .tmp, tokenizer.json, no index)
    are removed. Raises ValueError when it is a file, holds a token folder already, or holds other files."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file: give a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    if (out / INDEX_FILE).exists():
        raise ValueError(f"--out {out} holds a token folder already ({INDEX_FILE}): remove it or choose another folder")
    entries = list(out.iterdir())
    other = sorted(p.name for p in entries if not _OWN_FILE.match(p.name))
    if other:
        raise ValueError(f"--out {out} holds other files ({', '.join(other[:5])}): give a new or empty folder")
    for p in entries:
        p.unlink()
    return out
