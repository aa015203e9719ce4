"""`glm5lab tokenize` throughput on ~100 MB of text beside `tokenizers`' own batch encoding (issue 27), and its
peak RSS against the size of one document beside the whole-document encoding it replaced (`--memory`, issue 36).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tokenize_corpus.py               # 20 copies of the corpus
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tokenize_corpus.py --copies 2    # a smoke run
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tokenize_corpus.py --memory      # one document of 1 to 200 MB
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tokenize_corpus.py --memory --sizes 1,5 --one-line-sizes 5

(Not `benchmarks/tokenize.py`: run as a script, that name would shadow the standard library's `tokenize`
module, which `inspect`/`linecache` import.)

Text: the default Shakespeare corpus (42 texts, ~5 MB) copied `--copies` times into a temp folder
(copy-NN/NAME, so every document has its own name). Tokenizer: the default run's, a byte-level BPE of
vocabulary 4096 trained on the corpus's training split (`cached_tokenizer`, cached). In one process,
timed in turn:
- `glm5lab tokenize` (`tokenize_corpus`): stream the files, split by document, encode in batches of
  `BATCH_DOCS` documents (pieces, for a long one) with `encode_batch_fast`, append to uint16 shards, write the
  index;
- `tokenizers` alone on the same texts already in memory, the ids discarded: `encode_batch_fast` (no offsets;
  what glm5lab uses) and `encode_batch` (with offsets) on tokenize's batches (its documents' pieces of at
  most `PIECE_CHARS` characters, `BATCH_DOCS` pieces or `BATCH_CHARS` characters, whichever comes first; before
  issue 36 whole documents), and `encode_batch_fast` on `BATCH_DOCS` whole documents a call (the batches of
  `encode_documents`, gone in issue 37: larger here, whole plays).
MB/s counts the UTF-8 bytes of the text. `tokenizers` encodes a batch's documents on its Rayon thread pool
(`RAYON_NUM_THREADS`, default one per CPU); the figures say which. Peak RSS of the process after the
tokenize case (`ru_maxrss`) shows that it streams: it stays far below the text's size.

`--memory`: the corpus is ONE text file of `--sizes` MB (the default corpus's texts concatenated, repeated and
cut to size: prose with its newlines), and of `--one-line-sizes` MB with every newline made a space (one line of
tens of MB). A one-document corpus: its text is split inside, at the paragraph boundary nearest 95%. Tokenizer:
the default run's BPE (`--tokenizer`). Each case runs in a fresh process whose peak RSS (VmHWM) is the
figure: `glm5lab tokenize` (`tokenize_corpus`: the file read in chunks, encoded in pieces), and the whole-document
way it replaced (the text read whole, split, each part encoded whole: what tokenize did before issue 36 and
`glm5lab train --data FILE` in memory before issue 37), run only where it fits (its peak, ~160
bytes a character, under 60% of MemAvailable). A third process only imports and loads the tokenizer: the floor.
The two ways' tokens are compared by SHA-256 (identical is the claim).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MB = 1e6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=20, help="copies of the default corpus (default 20: ~108 MB)")
    p.add_argument("--memory", action="store_true", help="peak RSS against one document's size instead")
    p.add_argument("--sizes", default="1,20,60,200", help="--memory: MB of the prose document (default 1,20,60,200)")
    p.add_argument("--one-line-sizes", default="60", help="--memory: MB of the one-line document (default 60)")
    p.add_argument("--out", help="the JSON record (default benchmarks/results/tokenize.json, or tokenize_memory.json "
                   "with --memory)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # one measured case, in its own process
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.child:
        return child(*args.child)  # before `benchmarks.common`, which imports torch: not in the measured processes
    if args.memory:
        return memory(args)
    args.out = args.out or str(ROOT / "benchmarks" / "results" / "tokenize.json")
    from benchmarks.common import markdown_table, print_json_line
    from glm5lab.environment import env_facts
    from glm5lab.data.corpus import fetch_default_corpus
    from glm5lab.data.pipeline import prepare_data
    from glm5lab.data.sources import iter_documents
    from glm5lab.data.pieces import Cutter
    from glm5lab.data.tokenize import BATCH_CHARS, BATCH_DOCS, piece_batches, tokenize_corpus

    facts = env_facts("cpu")
    facts["load_average_start"] = list(os.getloadavg())
    rayon = os.environ.get("RAYON_NUM_THREADS", f"unset (one per CPU: {os.cpu_count()})")
    tok = prepare_data(4096, None, 0).tokenizer  # the default run's BPE
    corpus = fetch_default_corpus()
    results = {}
    with tempfile.TemporaryDirectory(prefix="glm5lab-tokenize-bench-") as tmp:
        tmp = Path(tmp)
        for c in range(args.copies):
            shutil.copytree(corpus, tmp / "text" / f"copy-{c:02d}")
        tok.save(str(tmp / "tokenizer.json"))
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        t0 = time.perf_counter()
        index = tokenize_corpus(tmp / "text", tmp / "tokens", tokenizer=tmp / "tokenizer.json", vocab_size=4096,
                                progress=False)
        results["glm5lab tokenize (read, split, encode_batch_fast, write shards)"] = time.perf_counter() - t0
        rss_tokenize = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        texts = [d.text for d in iter_documents(tmp / "text")]  # the baseline's input, loaded after
        nbytes = sum(len(t.encode()) for t in texts)
        tokens = sum(s["tokens"] for s in index["splits"].values())
        docs = sum(s["documents"] for s in index["splits"].values())
        cutter, _ = Cutter.of(tok)  # tokenize's batches: its documents' pieces
        same = [[text for _, _, text in b] for b in piece_batches((False, k == 0, piece) for t in texts
                                                                  for k, piece in enumerate(cutter.pieces([t])))]
        whole = [texts[lo:lo + BATCH_DOCS] for lo in range(0, len(texts), BATCH_DOCS)]
        for name, batches, label in (("encode_batch_fast", same, "tokenize's batches"),
                                     ("encode_batch", same, "tokenize's batches"),
                                     ("encode_batch_fast", whole, f"{BATCH_DOCS} documents a call")):
            encode, count = getattr(tok, name), 0
            t0 = time.perf_counter()
            for batch in batches:
                count += sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
            results[f"tokenizers {name}, texts in memory, {label}"] = time.perf_counter() - t0
            assert count + docs - len(index["splits"]) == tokens, (name, count, tokens)  # + EOT between documents
    rows = [[name, f"{s:.1f}", f"{nbytes / MB / s:.2f}", f"{tokens / s / 1e6:.2f}"] for name, s in results.items()]
    print(f"{nbytes / MB:.1f} MB of text ({docs:,} documents, {tokens:,} tokens; vocabulary 4096; batches of "
          f"{BATCH_DOCS} documents or {BATCH_CHARS:,} characters); tokenizers' "
          f"Rayon threads: {rayon}; load average at start {facts['load_average_start']}\n")
    print(markdown_table(["case", "s", "MB/s", "M tokens/s"], rows))
    first = next(iter(results.values()))
    fast = results["tokenizers encode_batch_fast, texts in memory, tokenize's batches"]
    print(f"\nglm5lab tokenize runs at {fast / first:.2f}x "
          f"encode_batch_fast's rate; peak RSS {rss_tokenize:.0f} MB after it ({rss_before:.0f} MB before; "
          f"the text is {nbytes / MB:.0f} MB)")
    facts["load_average_end"] = list(os.getloadavg())
    record = {"benchmark": "tokenize", "text_mb": nbytes / MB, "documents": docs, "tokens": tokens,
              "rayon_threads": rayon, "seconds": results, "mb_per_s": {k: nbytes / MB / s for k, s in results.items()},
              "maxrss_mb_before_tokenize": rss_before, "maxrss_mb_after_tokenize": rss_tokenize, **facts}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print_json_line(record)


def child(case: str, text_file: str, tokenizer: str, out: str = "") -> None:
    """One case, in this process: print {maxrss_mb, seconds, sha256 of the int64 train + val tokens, tokens}."""
    import hashlib

    import numpy as np

    from glm5lab.data.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    tok = load_tokenizer(Path(tokenizer))
    if case == "tokenize":
        from glm5lab.data.shards import open_token_folder
        from glm5lab.data.tokenize import tokenize_corpus

        tokenize_corpus(text_file, out, tokenizer=tokenizer, vocab_size=4096, progress=False)
        folder = open_token_folder(out)
        splits = [folder.train, folder.val]
    elif case == "whole":
        from glm5lab.data.corpus import Document, split_documents

        path = Path(text_file)
        (train,), (val,) = split_documents([Document(path.name, path.read_text(encoding="utf-8-sig"))])
        splits = [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch_fast([train.text, val.text],
                                                                                  add_special_tokens=False)]
    else:  # "floor": imports and the tokenizer only
        splits = []
    seconds = time.perf_counter() - t0
    maxrss = _peak_rss_mb()
    h = hashlib.sha256()
    for split in splits:  # hashed after the peak was read, split by split, in slices
        for lo in range(0, len(split), 1 << 22):
            h.update(np.asarray(split[lo:lo + (1 << 22)], dtype=np.int64).tobytes())
    print(json.dumps({"maxrss_mb": maxrss, "seconds": seconds, "sha256": h.hexdigest()[:16],
                      "tokens": [len(s) for s in splits]}))


def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM): unlike `ru_maxrss`, it does not count the parent's pages at the fork."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run_child(*argv: str) -> dict:
    import subprocess

    r = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"child {argv} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def _document(path: Path, corpus_text: str, mb: float, one_line: bool) -> int:
    """Write `mb` MB (10^6 characters, ASCII) of `corpus_text` repeated into `path`; returns its characters."""
    n = int(mb * MB)
    text = corpus_text.replace("\n", " ") if one_line else corpus_text
    with open(path, "w") as f:
        left = n
        while left:
            f.write(text[:left])
            left -= min(left, len(text))
    return n


def memory(args) -> None:
    from benchmarks.common import markdown_table, print_json_line
    from glm5lab.environment import env_facts
    from glm5lab.data.corpus import fetch_default_corpus
    from glm5lab.data.pipeline import prepare_data
    from glm5lab.data.pieces import PIECE_CHARS
    from glm5lab.data.sources import iter_documents
    from glm5lab.data.tokenize import BATCH_CHARS

    out = args.out or str(ROOT / "benchmarks" / "results" / "tokenize_memory.json")
    facts = env_facts("cpu")
    facts["load_average_start"] = list(os.getloadavg())
    rayon = os.environ.get("RAYON_NUM_THREADS", f"unset (one per CPU: {os.cpu_count()})")
    tok = prepare_data(4096, None, 0).tokenizer  # the default run's BPE
    corpus_text = "".join(d.text for d in iter_documents(fetch_default_corpus()))
    assert corpus_text.isascii()  # 1 MB = 10^6 characters = 10^6 bytes
    cases = [(float(s), False) for s in args.sizes.split(",") if s] + [
        (float(s), True) for s in args.one_line_sizes.split(",") if s]
    rows, records = [], []
    with tempfile.TemporaryDirectory(prefix="glm5lab-tokenize-memory-") as tmp:
        tmp = Path(tmp)
        tok.save(str(tmp / "tokenizer.json"))
        floor = _run_child("floor", "", str(tmp / "tokenizer.json"))
        for mb, one_line in cases:
            doc = tmp / "document.txt"
            chars = _document(doc, corpus_text, mb, one_line)
            new = _run_child("tokenize", str(doc), str(tmp / "tokenizer.json"), str(tmp / "tokens"))
            shutil.rmtree(tmp / "tokens")
            need, free = 160 * mb, _available_mb()
            old = _run_child("whole", str(doc), str(tmp / "tokenizer.json")) if need < 0.6 * free else None
            kind = "one line" if one_line else "prose"
            records.append({"document": kind, "mb": mb, "characters": chars, "new": new, "whole": old,
                            "whole_skipped": None if old else f"needs ~{need / 1e3:.1f} GB, {free / 1e3:.1f} GB "
                            "available", "identical": None if old is None else old["sha256"] == new["sha256"]})
            rows.append([kind, f"{mb:g}", f"{new['maxrss_mb']:.0f}", f"{new['seconds']:.0f}",
                         f"{old['maxrss_mb']:.0f}" if old else f"not run (~{need / 1e3:.0f} GB)",
                         f"{old['seconds']:.0f}" if old else "-",
                         "-" if old is None else ("yes" if old["sha256"] == new["sha256"] else "NO"),
                         f"{sum(new['tokens']):,}"])
            doc.unlink()
    facts["load_average_end"] = list(os.getloadavg())
    print(f"One document per corpus; the default run's BPE (vocabulary 4096); pieces of at most {PIECE_CHARS:,} "
          f"characters, batches of {BATCH_CHARS:,}; tokenizers' Rayon threads: {rayon}; torch not imported by the "
          f"measured processes; load average {facts['load_average_start']} at the start, "
          f"{facts['load_average_end']} at the end. Floor (imports + tokenizer): {floor['maxrss_mb']:.0f} MB.\n")
    print(markdown_table(["document", "MB", "tokenize peak RSS MB", "s", "whole-document peak RSS MB", "s",
                          "tokens identical", "tokens"], rows))
    record = {"benchmark": "tokenize_memory", "rayon_threads": rayon, "piece_chars": PIECE_CHARS,
              "batch_chars": BATCH_CHARS, "floor_maxrss_mb": floor["maxrss_mb"], "cases": records, **facts}
    Path(out).write_text(json.dumps(record, indent=2) + "\n")
    print_json_line(record)


if __name__ == "__main__":
    main()
