"""`glm5lab ablate STUDY`: run one study, write its folder, return the table.

Each study is the module `STUDIES` names, with `run(args: StudyArgs, bench: Workbench) -> StudyResult` (the seeds
of `StudyArgs.size_and_seeds`, ending `return result(raw, settings, seeds)`), `result(raw, settings, seeds) ->
StudyResult` (table, notes and plot from raw numbers and settings alone: what `--seeds N` re-renders after merging
new seeds into a folder, `extend_study`), `readme_row(info)` (`summary`) and its sizes in `SIZES`: a dict keyed by `StudyArgs.size_key`, each entry a dict
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
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from glm5lab.validate import int_at_least, one_of, refuse


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
                        "IndexCache at 1/2 and 1/4 of the indexers: training-free (searched, uniform) and "
                        "training-aware (own-loss warm-up, multi-layer distillation) vs full DSA: quality and time"),
    "baseline": Study("glm5lab.ablate.study_baseline", "the small preset vs a dense GPT (MHA, SwiGLU; AdamW and "
                      "Muon) at matched activated params and tokens"),
    "optimizer": Study("glm5lab.ablate.study_optimizer", "AdamW vs Muon vs Muon Split vs Muon Split with K/V apart on "
                       "the GLM-5 recipe, at equal tokens and equal compute (Newton-Schulz FLOPs charged)"),
}
SCALES = ("cpu", "gpu")
MAX_SEEDS = 1000
"""The most --seeds allowed: a quick seed takes seconds, a default-size one minutes (more is a typo)."""
SIZE_KEYS = ("quick", "cpu", "gpu", "gpu-quick")


@dataclass(frozen=True)
class StudyArgs:
    """study: one of STUDIES. quick: the under-two-minute size. out: results folder (default
    runs/ablate/<study>, with a -quick suffix for --quick). seeds: how many seeds (0..n-1;
    None = the study's default). progress: print one line per trained variant. data: the text
    corpus (`Workbench.load`; default: Shakespeare). scale: "cpu" (default) or "gpu" (larger
models and lengths; see the module docstring). first_seed: the first seed run (the runner sets it when
    --seeds extends a folder holding seeds 0..first_seed-1: `extend_study`). prior: that folder's settings (set
    with first_seed), so a study reuses what it computed once for all seeds instead of re-running it (the
    optimizer study's lr sweep)."""

    study: str
    quick: bool = False
    out: str | None = None
    seeds: int | None = None
    progress: bool = True
    data: str | None = None
    scale: str = "cpu"
    first_seed: int = 0
    prior: dict | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        one_of("--scale", self.scale, SCALES)
        if self.study not in STUDIES:
            raise ValueError(f"study {self.study!r} is not known: choose one of {', '.join(STUDIES)}")
        if self.seeds is not None:
            int_at_least("--seeds", self.seeds, 1)
            if self.seeds > MAX_SEEDS:
                refuse("--seeds", self.seeds, f"at most {MAX_SEEDS}")
        int_at_least("first_seed", self.first_seed, 0)

    @property
    def size_key(self) -> str:
        """Which entry of a study's SIZES this run uses: quick, cpu, gpu or gpu-quick."""
        if self.scale == "gpu":
            return "gpu-quick" if self.quick else "gpu"
        return "quick" if self.quick else "cpu"

    def size_and_seeds(self, table: dict) -> tuple[dict, list[int]]:
        """(table[self.size_key], seeds first_seed..n-1): n = --seeds, else that size's "seeds". Raises KeyError
        naming the missing size, ValueError when first_seed leaves no seed to run."""
        if self.size_key not in table:
            raise KeyError(f"study {self.study!r} has no size {self.size_key!r} (has {', '.join(table)})")
        size = table[self.size_key]
        n = self.seeds if self.seeds is not None else size["seeds"]
        if self.first_seed >= n:
            raise ValueError(f"first_seed = {self.first_seed} leaves no seed to run: below --seeds {n} needed")
        return size, list(range(self.first_seed, n))

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
    folder (`glm5lab.train.run_lock.hold_run_folder`); returns (path of table.md, the table text). A folder
    holding this study's results with seeds 0..m-1 and --seeds N > m is extended: only seeds m..N-1 run
    (`extend_study`). Raises RunFolderInUse (a ValueError naming the holder) when another study or run holds the
    folder, ValueError when it is a file or cannot be extended (`check_extension`), FileExistsError when it
    holds results and no --seeds is given (`check_out`)."""
    from glm5lab.ablate.results import run_record, write_result
    from glm5lab.ablate.workbench import Workbench
    from glm5lab.train.run_lock import hold_run_folder

    out = args.out_dir
    with hold_run_folder(out):  # one study or run at a time writes a folder: a second one is refused
        info = check_out(out, extend=args.seeds is not None)
        if info is not None:
            path = extend_study(args, info, out)
        else:
            t0 = time.perf_counter()
            result = study_module(args.study).run(args, Workbench.load(data=args.data))
            runs = [run_record(result.seeds, time.perf_counter() - t0, result.settings)]
            path = write_result(result, out, quick=args.quick, runs=runs, data=corpus(args.data))
    return path, path.read_text()


def corpus(data: str | None) -> str | None:
    """--data as results.json records it: an absolute path (None: the default corpus)."""
    return None if data is None else str(Path(data).resolve())


RESULT_FILES = ("results.json", "table.md")
"""A study's files that mark a folder as holding its results (`glm5lab.ablate.results.write_result`)."""


def check_out(out: Path, *, extend: bool = False) -> dict | None:
    """Refuse, before anything runs, an --out that is a file or holds a folder named results.json or table.md
    (ValueError) or that holds a study's results already
    (FileExistsError: they would be overwritten when the new run finishes; as `glm5lab train` refuses an --out
    holding a run), unless `extend` (--seeds given) and it holds results.json: then its parsed contents (to be
    extended; ValueError naming the file when it is not valid JSON or not a JSON object). An empty or missing
    folder, or one holding other files, is fine: None."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    odd = [name for name in RESULT_FILES if (out / name).exists() and not (out / name).is_file()]
    if odd:
        raise ValueError(f"--out {out}: {', '.join(odd)} is not a file; remove it or pick another --out")
    held = [name for name in RESULT_FILES if (out / name).is_file()]
    if not held:
        return None
    if extend and "results.json" not in held:
        raise FileExistsError(f"--out {out} holds {', '.join(held)} but no results.json: --seeds cannot extend it "
                              "(the raw numbers are in results.json); write into another folder with --out DIR")
    if not extend:
        raise FileExistsError(f"--out {out} already holds a study's results ({', '.join(held)}): write this run's "
                              f"into another folder with --out DIR, remove this one (rm -r {out}) to run the "
                              "study again, or add seeds to it with --seeds N (N more than it has)")
    return read_results(out / "results.json")


def read_results(path: Path) -> dict:
    """The parsed results.json at `path`. Raises ValueError naming the file when it is not UTF-8 JSON holding
    an object with "study", non-empty "seeds" (list), "settings" and "raw" (objects), and "quick" true or false
    where present, and "runs" where present a list of `good_run` records (a hand-edited or truncated file is
    refused rather than merged into a wrong table, or failing after the new seeds ran)."""
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); cannot extend it: remove the folder or pick another "
                         "--out") from e
    missing = [k for k in ("study", "seeds", "settings", "raw") if not isinstance(info, dict) or k not in info]
    if missing:
        got = f"an object without {', '.join(missing)}" if isinstance(info, dict) else type(info).__name__
        raise ValueError(f"{path}: a JSON object with study, seeds, settings and raw expected, got {got}; cannot "
                         "extend it")
    for key, kind, what in (("seeds", list, "list"), ("settings", dict, "object"), ("raw", dict, "object")):
        if not isinstance(info[key], kind) or not info[key]:
            raise ValueError(f"{path}: {key} is {short(info[key])}, a non-empty {what} expected; cannot extend it")
    if not isinstance(info.get("quick", False), bool):
        raise ValueError(f"{path}: quick is {info['quick']!r}, true or false expected; cannot extend it")
    runs = info.get("runs")
    if runs is not None and not (isinstance(runs, list) and all(good_run(r) for r in runs)):
        raise ValueError(f"{path}: runs is {short(runs)}, a list of objects with seeds (a list) and elapsed_s (a "
                         "number) expected; cannot extend it")
    return info


def good_run(record) -> bool:
    """Whether `record` is a "runs" entry the history can be extended with: an object with a seeds list and
    elapsed_s a number or null (`results.run_record`)."""
    if not isinstance(record, dict) or not isinstance(record.get("seeds"), list):
        return False
    elapsed = record.get("elapsed_s")
    return elapsed is None or (isinstance(elapsed, (int, float)) and not isinstance(elapsed, bool))


def check_extension(args: StudyArgs, info: dict, path: Path) -> int:
    """The first seed to run when `args` extends the results `info` read from `path`: m, the count of its seeds
    0..m-1. Raises ValueError in one line naming the field and both values when the folder holds another study,
    quick, scale, size or corpus than this run, seeds that are not 0..m-1, or at least --seeds N seeds already."""
    settings = info["settings"]  # an object: `read_results`
    module = study_module(args.study)
    recorded, wanted = recorded_size(settings), as_json(module.SIZES.get(args.size_key))
    checks = (("study", info["study"], args.study), ("quick", bool(info.get("quick")), args.quick),
              ("settings.scale", settings.get("scale", "cpu"), args.size_key),
              ("data (--data)", info.get("data"), corpus(args.data)))
    for name, old, new in checks:
        if old != new:
            raise ValueError(f"{path}: {name} is {old!r}, this run's {new!r}: only the same study, size and "
                             "corpus can be extended (pick another --out)")
    if recorded is not None and recorded != wanted:
        name, old, new = first_difference(recorded, wanted, "size")
        raise ValueError(f"{path}: {name} is {old!r}, this code's {new!r}: the study's size changed since those "
                         "seeds ran; extend with the code that ran them, or start another --out")
    seeds = info["seeds"]
    m = len(seeds)  # a list: `read_results`
    if seeds != list(range(m)):
        raise ValueError(f"{path}: seeds {seeds!r}, not 0..m-1: cannot extend them with --seeds")
    if args.seeds <= m:
        raise ValueError(f"--seeds {args.seeds}: {path.parent} already has {m} seeds {seeds}; pass more than {m} to "
                         f"add seeds {m}..N-1")
    return m


def recorded_size(settings: dict) -> dict | None:
    """The SIZES entry a results.json's settings record: "size" (most studies), "sizes" (swa), or efficient's
    "further" with its "base_sizes"; None when none is there."""
    if "size" in settings:
        return settings["size"]
    if "sizes" in settings:
        return settings["sizes"]
    if "further" in settings and "base_sizes" in settings:
        return {**settings["further"], "base": settings["base_sizes"]}
    return None


def first_difference(a, b, path: str) -> tuple[str, object, object]:
    """(path, a's value, b's value) of the first place two JSON values differ (a, b unequal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            if a.get(key, "<absent>") != b.get(key, "<absent>"):
                return first_difference(a.get(key, "<absent>"), b.get(key, "<absent>"), f"{path}.{key}")
    return path, a, b


def extend_study(args: StudyArgs, info: dict, out: Path) -> Path:
    """Run seeds m..N-1 of the study whose results `info` (out/results.json) hold seeds 0..m-1, merge them in
    (`merge_seeds`) and re-write out's table.md, results.json and PNG; returns table.md's path. Raises
    ValueError as `check_extension` before anything runs, and as `merge_seeds` (naming the conflicting path)
    after, when the new seeds' numbers or settings cannot be merged: then out's files are left as they were and
    the new seeds' own results are written to out/seeds-m-(N-1) (named in the message)."""
    import dataclasses

    from glm5lab.ablate.results import run_record, write_result
    from glm5lab.ablate.workbench import Workbench

    first = check_extension(args, info, out / "results.json")
    args.say(f"extending {out}: it has seeds 0..{first - 1}, running {first}..{args.seeds - 1}")
    t0 = time.perf_counter()
    new = study_module(args.study).run(dataclasses.replace(args, first_seed=first, prior=info["settings"]),
                                       Workbench.load(data=args.data))
    record = run_record(new.seeds, time.perf_counter() - t0, new.settings)
    try:
        merged, runs = merge_seeds(info, new, record=record)
    except ValueError as e:  # keep what the new seeds cost: they can be merged by hand (`merge_seeds`)
        kept = out / f"seeds-{first}-{args.seeds - 1}"
        write_result(new, kept, quick=args.quick, runs=[record], data=corpus(args.data))
        raise ValueError(f"{e}; {out}'s files are left as they were, the new seeds' results are in {kept} "
                         "(glm5lab.ablate.runner.merge_seeds merges them once the difference is resolved)") from e
    return write_result(merged, out, quick=bool(info.get("quick")), runs=runs, data=info.get("data"))


def merge_seeds(info: dict, new, *, elapsed_s: float | None = None, record: dict | None = None):
    """(merged StudyResult, runs history) of an old parsed results.json `info` and a StudyResult `new` of other
    seeds of the same study (run here, or computed elsewhere): raw and settings merged by
    `merge.merge_json` (settings' device and threads keep the old values; each run's are in its record), the
    table, notes and plot re-rendered from them by the study's `result(raw, settings, seeds)`, seeds = old +
    new. record: the new run's history entry (`results.run_record`), else one made here from `elapsed_s`. The
    history: info["runs"], or for a file from before it, one entry made from its top-level seeds, elapsed_s,
    git_commit and torch. Write both with `results.write_result(merged, out, quick=..., runs=...)`. Raises
    ValueError when the studies differ, the seed sets overlap, or the numbers conflict (naming the path)."""
    from glm5lab.ablate.merge import merge_json
    from glm5lab.ablate.results import run_record

    old_seeds, new_seeds = list(info["seeds"]), list(new.seeds)
    if info["study"] != new.study:
        raise ValueError(f"study: the old results are {info['study']!r}, the new seeds {new.study!r}")
    if set(old_seeds) & set(new_seeds):
        raise ValueError(f"seeds: the new seeds {new_seeds} overlap the old {old_seeds}")
    module = study_module(new.study)
    n_old, n_new = len(old_seeds), len(new_seeds)
    raw = merge_json(info["raw"], as_json(new.raw), n_old, n_new, path="raw")
    settings = merge_json(info["settings"], as_json(new.settings), n_old, n_new, path="settings",
                          per_seed_lists=False, keep_old=("device", "threads"))
    if record is None:
        if elapsed_s is None:
            raise ValueError("merge_seeds: give elapsed_s or record for the new seeds' history entry")
        record = run_record(new_seeds, elapsed_s, new.settings)
    runs = list(info.get("runs") or [old_record(info)])
    return module.result(raw, settings, old_seeds + new_seeds), runs + [record]


def old_record(info: dict) -> dict:
    """The one history entry of a results.json from before "runs": its top-level seeds, elapsed_s, git_commit
    and torch (date unknown: None), and its settings' device and threads where recorded."""
    settings = info.get("settings") if isinstance(info.get("settings"), dict) else {}
    return ({"seeds": info["seeds"], "elapsed_s": info.get("elapsed_s"), "git_commit": info.get("git_commit"),
             "torch": info.get("torch"), "date": info.get("date")}
            | {k: settings[k] for k in ("device", "threads") if k in settings})


def short(value) -> str:
    """`value` as JSON, cut at 80 characters (`merge._short`)."""
    from glm5lab.ablate.merge import _short

    return _short(value)


def as_json(value):
    """`value` as results.json holds it (`merge.as_json`)."""
    from glm5lab.ablate.merge import as_json as round_trip

    return round_trip(value)


def study_module(study: str):
    """The module of `study` (one of STUDIES). Raises KeyError for an unknown study."""
    return importlib.import_module(STUDIES[study].module)
