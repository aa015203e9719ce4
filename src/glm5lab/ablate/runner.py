"""`glm5lab ablate STUDY`: run one study, write its folder, return the table.

Each study is a module `glm5lab.ablate.study_<name>` with `run(args: StudyArgs, bench: Workbench)
-> StudyResult` and `DEFAULT_SEEDS`; `--quick` sizes finish in under two minutes on 2 CPU cores
(the test suite runs them), the default sizes in under an hour (BENCHMARKS.md has the times).
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path

STUDIES = {
    "mla": "GQA-8 vs MLA vs MLA + Muon Split vs MLA-256 + Muon Split at matched tokens (3 seeds)",
    "dsa": "dense vs indexer warm-up only vs full sparse adaptation, retrieval by context length",
    "swa": "full attention vs 1:1 SWA interleave vs searched SWA, no extra training",
    "efficient": "SWA interleave, searched SWA, Gated DeltaNet, SimpleGDN after equal further training",
    "mtp": "MTP acceptance length vs draft steps 1..4; training unroll depth 1 vs 3",
    "indexcache": "IndexCache retention 1, 1/2, 1/4 (searched and uniform): quality and attention time",
}


@dataclass(frozen=True)
class StudyArgs:
    """study: one of STUDIES. quick: the under-two-minute size. out: results folder (default
    runs/ablate/<study>, with a -quick suffix for --quick). seeds: how many seeds (0..n-1;
    None = the study's default). progress: print one line per trained variant. data: the text
    corpus (`Workbench.load`; default: Shakespeare)."""

    study: str
    quick: bool = False
    out: str | None = None
    seeds: int | None = None
    progress: bool = True
    data: str | None = None

    def __post_init__(self):
        if self.study not in STUDIES:
            raise ValueError(f"study {self.study!r} is not known: choose one of {', '.join(STUDIES)}")
        if self.seeds is not None and (isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 1):
            raise ValueError(f"--seeds {self.seeds!r} is not allowed: an integer >= 1")

    @property
    def out_dir(self) -> Path:
        """The results folder: --out, else runs/ablate/<study>[-quick]."""
        return Path(self.out) if self.out else Path("runs/ablate") / (self.study + ("-quick" if self.quick else ""))

    def seed_list(self, default: int) -> list[int]:
        """Seeds 0..n-1: n = --seeds, else the study's `default`."""
        return list(range(self.seeds if self.seeds is not None else default))

    def say(self, message: str) -> None:
        """Print one progress line, prefixed with the study, unless progress is off."""
        if self.progress:
            print(f"[{self.study}] {message}", flush=True)


def run_study(args: StudyArgs) -> tuple[Path, str]:
    """Run the study and write its folder; returns (path of table.md, the table text).
    Raises ValueError when the output folder is a file."""
    from glm5lab.ablate.results import write_result
    from glm5lab.ablate.workbench import Workbench

    out = args.out_dir
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    t0 = time.perf_counter()
    module = importlib.import_module(f"glm5lab.ablate.study_{args.study}")
    result = module.run(args, Workbench.load(data=args.data))
    path = write_result(result, out, quick=args.quick, elapsed_s=time.perf_counter() - t0)
    return path, path.read_text()
