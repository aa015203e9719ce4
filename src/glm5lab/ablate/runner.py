"""`glm5lab ablate STUDY`: run one study, write its folder, return the table.

Each study is the module `STUDIES` names, with `run(args: StudyArgs, bench: Workbench) -> StudyResult`,
`readme_row(info)` (`summary`) and its sizes in `SIZES`: a dict keyed by `StudyArgs.size_key`, each entry a dict
of that size's numbers, its "seeds" (how many seeds run unless --seeds: `StudyArgs.size_and_seeds`) among them:
  "quick"      `--quick`: the smoke size, under two minutes on 2 CPU cores (the test suite runs it);
  "cpu"        the default: 8 to 72 minutes per study on 2 cores, about three hours for all eight
               (the README's generated table and BENCHMARKS.md have the times);
  "gpu"        `--scale gpu`: models of about 50-100M parameters at lengths where DSA and SWA
               matter (2K-8K tokens), for a GPU (each study's docstring states its expected time);
  "gpu-quick"  `--scale gpu --quick`: the gpu shapes and lengths with a handful of steps and rows,
               so the gpu code path runs (slowly) on a CPU; `pytest -m slow` runs it.
Models train on `StudyArgs.device` (CUDA when `--scale gpu` finds one, else CPU), in fp32.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from glm5lab.validate import int_at_least, one_of


class Study(NamedTuple):
    """module: the study's module, imported by this name when it runs (`study_module`); what: its
    line in `glm5lab ablate -h` (the registry is read without importing torch)."""

    module: str
    what: str


STUDIES = {
    "mla": Study("glm5lab.ablate.study_mla",
                 "GQA-8 vs MLA vs MLA + Muon Split vs MLA-256 + Muon Split at matched tokens (3 seeds)"),
    "dsa": Study("glm5lab.ablate.study_dsa",
                 "dense vs indexer warm-up only vs full sparse adaptation, retrieval by context length"),
    "swa": Study("glm5lab.ablate.study_swa", "full attention vs 1:1 SWA interleave vs searched SWA, no extra training"),
    "efficient": Study("glm5lab.ablate.study_efficient",
                       "SWA interleave, searched SWA, Gated DeltaNet, SimpleGDN after equal further training"),
    "mtp": Study("glm5lab.ablate.study_mtp", "MTP acceptance length vs draft steps 1..4; training unroll depth 1 vs 3"),
    "indexcache": Study("glm5lab.ablate.study_indexcache",
                        "IndexCache retention 1, 1/2, 1/4 (searched and uniform): quality and attention time"),
    "baseline": Study("glm5lab.ablate.study_baseline", "the small preset vs a dense GPT (MHA, SwiGLU; AdamW and "
                      "Muon) at matched activated params and tokens"),
    "optimizer": Study("glm5lab.ablate.study_optimizer", "AdamW vs Muon vs Muon Split vs Muon Split with K/V apart on "
                       "the GLM-5 recipe, at equal tokens and equal compute (Newton-Schulz FLOPs charged)"),
}
SCALES = ("cpu", "gpu")
SIZE_KEYS = ("quick", "cpu", "gpu", "gpu-quick")


@dataclass(frozen=True)
class StudyArgs:
    """study: one of STUDIES. quick: the under-two-minute size. out: results folder (default
    runs/ablate/<study>, with a -quick suffix for --quick). seeds: how many seeds (0..n-1;
    None = the study's default). progress: print one line per trained variant. data: the text
    corpus (`Workbench.load`; default: Shakespeare). scale: "cpu" (default) or "gpu" (larger
models and lengths; see the module docstring)."""

    study: str
    quick: bool = False
    out: str | None = None
    seeds: int | None = None
    progress: bool = True
    data: str | None = None
    scale: str = "cpu"

    def __post_init__(self):
        one_of("--scale", self.scale, SCALES)
        if self.study not in STUDIES:
            raise ValueError(f"study {self.study!r} is not known: choose one of {', '.join(STUDIES)}")
        if self.seeds is not None:
            int_at_least("--seeds", self.seeds, 1)

    @property
    def size_key(self) -> str:
        """Which entry of a study's SIZES this run uses: quick, cpu, gpu or gpu-quick."""
        if self.scale == "gpu":
            return "gpu-quick" if self.quick else "gpu"
        return "quick" if self.quick else "cpu"

    def size_and_seeds(self, table: dict) -> tuple[dict, list[int]]:
        """(table[self.size_key], seeds 0..n-1): n = --seeds, else that size's "seeds". Raises KeyError naming
        the missing size."""
        if self.size_key not in table:
            raise KeyError(f"study {self.study!r} has no size {self.size_key!r} (has {', '.join(table)})")
        size = table[self.size_key]
        return size, list(range(self.seeds if self.seeds is not None else size["seeds"]))

    @property
    def device(self):
        """torch.device the study trains on: cuda under --scale gpu when available, else cpu."""
        import torch

        return torch.device("cuda" if self.scale == "gpu" and torch.cuda.is_available() else "cpu")

    @property
    def out_dir(self) -> Path:
        """The results folder: --out, else runs/ablate/<study>[-gpu][-quick]."""
        if self.out:
            return Path(self.out)
        return Path("runs/ablate") / (self.study + ("-gpu" if self.scale == "gpu" else "") + ("-quick" if self.quick else ""))

    def say(self, message: str) -> None:
        """Print one progress line, prefixed with the study, unless progress is off."""
        if self.progress:
            print(f"[{self.study}] {message}", flush=True)


def run_study(args: StudyArgs) -> tuple[Path, str]:
    """Run the study and write its folder, which it holds for the whole study as `glm5lab train` holds its run
    folder (`glm5lab.train.run_lock.hold_run_folder`); returns (path of table.md, the table text). Raises
    RunFolderInUse (a ValueError naming the holder) when another study or run holds the folder, ValueError when
    it is a file, FileExistsError when it holds a study's results already (`check_out`)."""
    from glm5lab.ablate.results import write_result
    from glm5lab.ablate.workbench import Workbench
    from glm5lab.train.run_lock import hold_run_folder

    out = args.out_dir
    with hold_run_folder(out):  # one study or run at a time writes a folder: a second one is refused
        check_out(out)
        t0 = time.perf_counter()
        result = study_module(args.study).run(args, Workbench.load(data=args.data))
        path = write_result(result, out, quick=args.quick, elapsed_s=time.perf_counter() - t0)
    return path, path.read_text()


RESULT_FILES = ("results.json", "table.md")
"""A study's files that mark a folder as holding its results (`glm5lab.ablate.results.write_result`)."""


def check_out(out: Path) -> None:
    """Refuse, before anything runs, an --out that is a file (ValueError) or that holds a study's results already
    (FileExistsError: they would be overwritten when the new run finishes; as `glm5lab train` refuses an --out
    holding a run). An empty or missing folder, or one holding other files, is fine."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    held = [name for name in RESULT_FILES if (out / name).is_file()]
    if held:
        raise FileExistsError(f"--out {out} already holds a study's results ({', '.join(held)}): write this run's "
                              f"into another folder with --out DIR, or remove this one (rm -r {out}) to run the "
                              "study again")


def study_module(study: str):
    """The module of `study` (one of STUDIES). Raises KeyError for an unknown study."""
    return importlib.import_module(STUDIES[study].module)
