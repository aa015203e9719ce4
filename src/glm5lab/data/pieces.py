r"""A long text cut into pieces that a tokenizer encodes, one by one, to exactly the tokens of the whole text:
how `glm5lab tokenize` keeps its memory bounded whatever one document's size (the whole-text encoding is the
reference; tests/train/test_pieces.py pins the two equal).

A `tokenizers` tokenizer encodes in stages: its added tokens (`<|endoftext|>`, ...) are matched first
(leftmost-longest) and split off, the rest is cut into pre-tokens by a regex, and the model encodes each
pre-token alone (BPE merges never cross one). So a cut at a pre-token boundary that no added token spans gives
the same tokens in two pieces as whole, provided each piece's pre-tokens are the whole text's: a regex with
greedy runs and a lookahead (`\s+(?!\S)`) decides a pre-token from what follows it, so not every boundary of a
piece is one of the whole text. `Cutter` cuts only at anchors where that is shown for the regexes it knows;
any other tokenizer is encoded whole (`Cutter.of` says why).

Anchors: a cut at index b (between text[b-1] and text[b]) where
- A1: text[b] is a space (U+0020) and text[b-1] is not whitespace, or
- A2: text[b-1] is a letter (\p{L}) and text[b] is not, as the tokenizer's own regex engine classifies them
  (the pre-tokenizer is asked: "a" + c is one pre-token exactly when c is a letter);
and no occurrence of an added token's content spans b. Why a cut there is exact, for the GPT-2 pattern (the
ByteLevel pre-tokenizer: glm5lab's byte-level BPE) and the Llama-3 / GLM-4 / Qwen2 patterns (`PATTERNS`):
(1) no alternative matches a non-space followed by a space, or a letter followed by a non-letter (a leading
optional space or symbol is the only non-letter a match holds before letters), so a pre-token of the whole
text ends at b; (2) the pre-tokens before b read nothing after text[b], and a space or non-letter at b decides
them as the end of the string does (greedy runs stop at both, `(?!\S)` holds at both, contractions fail at
both), so the left piece ends in the same pre-tokens; (3) no pattern looks behind, so the right piece starts as
the whole text does at b. Added tokens matched leftmost-longest find the same occurrences on both sides when none
spans b; flags that widen a match (`lstrip`, `rstrip`, `single_word`) are not cut around (encoded whole).

Memory: pieces are at most `PIECE_CHARS` characters, unless the text holds no anchor for longer (a run of
whitespace, digits or symbols, or one word: about one pre-token, which no exact encoding can cut); that stretch
is then held whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator

PIECE_CHARS = 1 << 16
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")  # GLM-4 / GLM-4.5 and Llama-3
PATTERNS = (GPT2_PATTERN, LLAMA3_PATTERN, LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}"))  # the last: Qwen2
_CANDIDATES = re.compile(r"(?<=\S)(?= )|(?<=[^\W\d_])(?=[\W\d_])")  # A1, and A2 as Python sees letters
_SEARCH = 4096  # characters searched back for an anchor at a time


class Cutter:
    """Cuts texts into pieces of at most `size` (default `PIECE_CHARS`) characters at anchors (module docstring)
    for one tokenizer; `Cutter.of(tokenizer)` makes one. `pieces(chunks)` takes a text as consecutive chunks (any
    sizes) and yields its pieces in order: they concatenate to the text, each encodes alone to its share of the
    whole text's tokens, and each is at most `size` characters unless no anchor comes sooner."""

    def __init__(self, pre_tokenizer, added: Iterable[str] = (), size: int | None = None):
        self.pre_tokenizer, self.size = pre_tokenizer, size or PIECE_CHARS
        self.added = sorted({a for a in added if a}, key=len)
        self.reach = max(1, max((len(a) for a in self.added), default=1) - 1)  # characters seen after a cut
        self._letters: dict[str, bool | None] = {}

    @classmethod
    def of(cls, tokenizer, size: int | None = None) -> tuple[Cutter | None, str | None]:
        """(a Cutter for `tokenizer`, None), or (None, why its documents must be encoded whole): a normalizer, a
        pre-tokenizer other than those `PATTERNS` name, truncation or padding set, or an added token with
        lstrip / rstrip / single_word."""
        spec = json.loads(tokenizer.to_str())
        why = _not_cuttable(spec)
        if why:
            return None, why
        return cls(tokenizer.pre_tokenizer, (t["content"] for t in spec.get("added_tokens") or []), size), None

    def pieces(self, chunks: Iterable[str]) -> Iterator[str]:
        """Yield the pieces of the text that `chunks` yields in consecutive parts (any sizes; it holds at most
        the unfinished piece plus one chunk); they concatenate back to the text."""
        buf, pos, seen = "", 0, 0  # seen: no anchor in (pos + size, seen], so a long stretch is searched once
        for chunk in chunks:
            buf, pos, seen = buf[pos:] + chunk, 0, max(0, seen - pos)
            while len(buf) - pos > self.size:
                cut, seen = self._cut(buf, pos, seen)
                if cut is None:
                    break  # no anchor yet: read on
                yield buf[pos:cut]
                pos = cut
        if pos < len(buf):
            yield buf[pos:]

    def _cut(self, buf: str, pos: int, seen: int) -> tuple[int | None, int]:
        """(the last anchor in (pos, pos + size], else the first one after max(pos + size, seen), else None; how
        far the search went)."""
        last = len(buf) - self.reach  # an added token spanning the cut lies inside buf
        hi = min(pos + self.size, last)
        lo = max(pos + 1, hi - _SEARCH)
        while hi >= pos + 1:
            for b in reversed([m.start() for m in _CANDIDATES.finditer(buf, lo, hi + 1)]):
                if self._anchor(buf, b):
                    return b, seen
            hi, lo = lo - 1, max(pos + 1, lo - 2 * (hi - lo + 1))
        for m in _CANDIDATES.finditer(buf, max(min(pos + self.size, last), seen) + 1, last + 1):
            if self._anchor(buf, m.start()):
                return m.start(), m.start()
        return None, max(last, seen)

    def _anchor(self, buf: str, b: int) -> bool:
        before, at = buf[b - 1], buf[b]
        if not ((at == " " and not before.isspace()) or (self._letter(before) is True and self._letter(at) is False)):
            return False
        for token in self.added:  # the first occurrence within len - 1 characters either side starts before b: spans it
            n = len(token)
            if 0 <= buf.find(token, max(0, b - n + 1), b + n - 1) < b:
                return False
        return True

    def _letter(self, char: str) -> bool | None:
        """Whether the pre-tokenizer's regex counts `char` as a letter (\\p{L}): it joins "a" + char. None for a
        character it cannot take (a lone surrogate): never part of an anchor."""
        if char not in self._letters:
            try:
                self._letters[char] = len(self.pre_tokenizer.pre_tokenize_str("a" + char)) == 1
            except Exception:  # tokenizers raises a bare Exception
                self._letters[char] = None
        return self._letters[char]


def _not_cuttable(spec: dict) -> str | None:
    if spec.get("normalizer") is not None:
        return f"its normalizer ({spec['normalizer'].get('type')}) may join characters across a cut"
    if not _known_pre_tokenizer(spec.get("pre_tokenizer")):
        pre = spec.get("pre_tokenizer")
        return (f"its pre-tokenizer ({json.dumps(pre)[:120]}) is not the byte-level GPT-2, Llama-3/GLM or Qwen2 "
                "pattern whose boundaries glm5lab knows")
    for key in ("truncation", "padding"):
        if spec.get(key) is not None:
            return f"it has {key} set"
    for t in spec.get("added_tokens") or []:
        flags = [f for f in ("lstrip", "rstrip", "single_word") if t.get(f)]
        if flags:
            return f"its added token {t['content']!r} has {'/'.join(flags)} set"
    return None


def _known_pre_tokenizer(pre) -> bool:
    if not isinstance(pre, dict):
        return False
    if pre.get("type") == "ByteLevel":
        return pre.get("use_regex", True) and not pre.get("add_prefix_space", True)
    if pre.get("type") != "Sequence" or len(pre.get("pretokenizers", [])) != 2:
        return False
    split, byte_level = pre["pretokenizers"]
    return (split.get("type") == "Split" and split.get("pattern", {}).get("Regex") in PATTERNS
            and split.get("behavior") == "Isolated" and not split.get("invert")
            and byte_level.get("type") == "ByteLevel" and not byte_level.get("use_regex", True)
            and not byte_level.get("add_prefix_space", True))
