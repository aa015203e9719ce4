"""Write a folder of parquet files with a `text` column, one row per document, from the default corpus (or any
corpus `glm5lab train --data` reads): the input of the README's "from your corpus" path when you have no parquet
of your own.

    python scripts/example_parquet.py OUT_DIR [--data PATH] [--files N]

Needs the `data` extra (`pip install -e .[data]`: the `datasets` library writes the files).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from datasets import Dataset, disable_progress_bars

from glm5lab.data.corpus import fetch_default_corpus
from glm5lab.data.sources import iter_documents


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder to write part-0000N.parquet into (created)")
    p.add_argument("--data", type=Path, help="a corpus as `glm5lab train --data` takes it (default: Shakespeare)")
    p.add_argument("--files", type=int, default=4, help="parquet files to spread the documents over (default 4)")
    args = p.parse_args()
    disable_progress_bars()
    docs = list(iter_documents(args.data or fetch_default_corpus()))
    args.out.mkdir(parents=True, exist_ok=True)
    for i in range(args.files):
        part = docs[i::args.files]
        Dataset.from_dict({"id": [d.name for d in part], "text": [d.text for d in part]}).to_parquet(
            args.out / f"part-{i:05d}.parquet")
    print(f"{len(docs)} documents in {args.files} parquet files under {args.out} (columns id, text)")


if __name__ == "__main__":
    main()
