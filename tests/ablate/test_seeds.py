"""`glm5lab ablate STUDY --seeds N` into a folder holding seeds 0..m-1 runs only seeds m..N-1 and merges them
(`runner.extend_study`, `runner.merge_seeds`, `merge.merge_json`): the merged raw numbers, settings and table
equal one run of N seeds (times aside); the history records both runs; what cannot be extended is refused in
one line before anything trains."""

import json
import shutil

import pytest

from glm5lab.ablate.merge import merge_json
from glm5lab.ablate.results import StudyResult
from glm5lab.ablate.runner import StudyArgs, merge_seeds, run_study
from glm5lab.ablate.summary import load_results, summary_table
from glm5lab.cli import main

TIMED = ("seconds", "tokens_per_s", "_ms")
"""Raw keys holding wall times (and rates from them): they differ between any two runs."""
EXTENDED = ("mla", "dsa", "mtp", "optimizer", "swa")
"""mla: per-arm dicts keyed by seed (as baseline, efficient); dsa: per-seed lists; mtp: the seed outermost;
optimizer: a sweep before the seeds, budget -> arm -> seed; swa: per-seed entries in settings too."""


def untimed(value):
    """`value` without the keys of TIMED at any depth."""
    if isinstance(value, dict):
        return {k: untimed(v) for k, v in value.items() if not any(t in k for t in TIMED)}
    return value


def body(table_md: str) -> str:
    """table.md without its title and seeds line (which name the runs)."""
    return table_md.split("\n", 3)[3]


@pytest.fixture(scope="module")
def extended(tmp_path_factory, study_corpus):
    """study -> folder of `--quick --seeds 1` then `--quick --seeds 2` into it (run on first ask). The optimizer
    study's extension must reuse the folder's lr sweep: its `sweep` fails if called."""
    from glm5lab.ablate import study_optimizer

    made = {}

    def no_sweep(*args, **kwargs):
        raise AssertionError("the lr sweep ran again for an extension")

    def get(study: str):
        if study not in made:
            out = tmp_path_factory.mktemp(f"{study}-extended") / study
            run_study(StudyArgs(study, quick=True, seeds=1, out=str(out), progress=False, data=str(study_corpus)))
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(study_optimizer, "sweep", no_sweep)
                run_study(StudyArgs(study, quick=True, seeds=2, out=str(out), progress=False, data=str(study_corpus)))
            made[study] = out
        return made[study]

    return get


@pytest.mark.parametrize("study", EXTENDED)
def test_adding_a_seed_equals_running_both_at_once(study, extended, two_seed_run, study_corpus):
    out, once = extended(study), two_seed_run(study)
    a, b = (json.loads((d / "results.json").read_text()) for d in (out, once))
    assert a["seeds"] == b["seeds"] == [0, 1]
    assert untimed(a["raw"]) == untimed(b["raw"])
    assert a["raw"].keys() == b["raw"].keys() and json.dumps(untimed(a["raw"])) == json.dumps(untimed(b["raw"]))
    assert untimed(a["settings"]) == untimed(b["settings"])
    if study != "optimizer":  # its table and notes show training seconds
        assert a["notes"] == b["notes"]
        assert body((out / "table.md").read_text()) == body((once / "table.md").read_text())
    assert [r["seeds"] for r in a["runs"]] == [[0], [1]] and [r["seeds"] for r in b["runs"]] == [[0, 1]]
    assert a["elapsed_s"] == round(sum(r["elapsed_s"] for r in a["runs"]), 1)
    assert a["git_commit"] == a["runs"][-1]["git_commit"] and a["data"] == str(study_corpus.resolve())
    lines = (out / "table.md").read_text().splitlines()
    assert lines[2].startswith("Seeds [0, 1] (n = 2) from 2 runs: [0] at commit ") and "; [1] at commit " in lines[2]
    assert (once / "table.md").read_text().splitlines()[2].startswith("Seeds [0, 1] (n = 2). ")
    assert (out / f"{study}.png").stat().st_size > 1000


def copy_of(src, tmp_path, edit=None):
    """A copy of the results folder `src` in tmp_path/STUDY, its results.json changed by edit(info)."""
    out = tmp_path / src.name
    shutil.copytree(src, out)
    if edit is not None:
        path = out / "results.json"
        info = json.loads(path.read_text())
        edit(info)
        path.write_text(json.dumps(info))
    return out


def refused(capsys, *argv) -> str:
    """The one-line error of `glm5lab ablate ARGV` (exit 2)."""
    capsys.readouterr()  # what came before (a fixture tokenizing its corpus)
    assert main(["ablate", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.removeprefix("glm5lab ablate: error: ").rstrip()


def test_what_cannot_be_extended_is_refused_before_anything_runs(two_seed_run, study_corpus, tmp_path, capsys):
    src, data = two_seed_run("mla"), str(study_corpus)
    out = copy_of(src, tmp_path)
    before = (out / "results.json").read_text()
    assert refused(capsys, "mla", "--quick", "--out", str(out), "--data", data) == (
        f"--out {out} already holds a study's results (results.json, table.md): write this run's into another "
        f"folder with --out DIR, remove this one (rm -r {out}) to run the study again, or add seeds to it with "
        "--seeds N (N more than it has)")
    assert refused(capsys, "mla", "--quick", "--seeds", "2", "--out", str(out), "--data", data) == (
        f"--seeds 2: {out} already has 2 seeds [0, 1]; pass more than 2 to add seeds 2..N-1")
    path = out / "results.json"
    cases = [
        (("dsa", "--quick"), None, f"{path}: study is 'mla', this run's 'dsa'"),
        (("mla",), None, f"{path}: quick is True, this run's False"),
        (("mla", "--quick", "--scale", "gpu"), None, f"{path}: settings.scale is 'quick', this run's 'gpu-quick'"),
        (("mla", "--quick"), "no-data", f"{path}: data (--data) is {str(study_corpus.resolve())!r}, this run's None"),
    ]
    for argv, flag, start in cases:
        extra = [] if flag == "no-data" else ["--data", data]
        assert refused(capsys, *argv, "--seeds", "3", "--out", str(out), *extra).startswith(start)
    assert path.read_text() == before

    def smaller(info):
        info["settings"]["size"]["steps"] += 1

    out = copy_of(src, tmp_path / "size", smaller)
    steps = json.loads((out / "results.json").read_text())["settings"]["size"]["steps"]
    assert refused(capsys, "mla", "--quick", "--seeds", "3", "--out", str(out), "--data", data) == (
        f"{out / 'results.json'}: size.steps is {steps}, this code's {steps - 1}: the study's size changed since "
        "those seeds ran; extend with the code that ran them, or start another --out")

    out = copy_of(src, tmp_path / "gap", lambda info: info.update(seeds=[0, 2]))
    assert refused(capsys, "mla", "--quick", "--seeds", "3", "--out", str(out), "--data", data) == (
        f"{out / 'results.json'}: seeds [0, 2], not 0..m-1: cannot extend them with --seeds")

    (out / "results.json").unlink()
    assert refused(capsys, "mla", "--quick", "--seeds", "3", "--out", str(out), "--data", data) == (
        f"--out {out} holds table.md but no results.json: --seeds cannot extend it (the raw numbers are in "
        "results.json); write into another folder with --out DIR")
    for text, what in (("{not json", "not valid JSON"), ("[1, 2]", "got list"), ('{"study": "mla"}', "got an object "
                                                                                                  "without seeds")):
        (out / "results.json").write_text(text)
        err = refused(capsys, "mla", "--quick", "--seeds", "3", "--out", str(out), "--data", data)
        assert err.startswith(f"{out / 'results.json'}: ") and what in err


def test_a_conflict_after_the_new_seeds_ran_keeps_them_apart(two_seed_run, study_corpus, tmp_path, capsys):
    """Settings that differ outside the size (here a hand edit) are found only when merging: the folder is left as
    it was and seed 2's results are written beside, to merge by hand."""
    out = copy_of(two_seed_run("mla"), tmp_path, lambda info: info["settings"].update(steps=999))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    err = refused(capsys, "mla", "--quick", "--seeds", "3", "--out", str(out), "--data", str(study_corpus))
    steps = json.loads((two_seed_run("mla") / "results.json").read_text())["settings"]["steps"]
    assert err == (f"settings.steps: the old seeds' 999 and the new seeds' {steps} cannot be merged (neither "
                   f"per-seed entries nor equal); {out}'s files are left as they were, the new seeds' results are in "
                   f"{out / 'seeds-2-2'} (glm5lab.ablate.runner.merge_seeds merges them once the difference is "
                   "resolved)")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    kept = json.loads((out / "seeds-2-2" / "results.json").read_text())
    assert kept["seeds"] == [2] and list(kept["raw"]["MLA"]) == ["2"]


def test_an_old_results_json_without_runs_or_data_is_extended(two_seed_run, study_corpus, tmp_path, capsys):
    """A file from before the history: one run made from its top-level fields; no "data" = the default corpus,
    so extending it with --data is refused, and merge_seeds takes it as it is."""
    def old(info):
        for key in ("runs", "data"):
            del info[key]

    out = copy_of(two_seed_run("mla"), tmp_path, old)
    info = json.loads((out / "results.json").read_text())
    assert refused(capsys, "mla", "--quick", "--seeds", "3", "--out", str(out), "--data", str(study_corpus)) == (
        f"{out / 'results.json'}: data (--data) is None, this run's {str(study_corpus.resolve())!r}: only the same "
        "study, size and corpus can be extended (pick another --out)")
    raw = {arm: {"2": per_seed["1"]} for arm, per_seed in info["raw"].items()}
    merged, runs = merge_seeds(info, StudyResult("mla", "", raw, info["settings"], [2], lambda p: None),
                               elapsed_s=2.5)
    assert merged.seeds == [0, 1, 2] and list(merged.raw["MLA"]) == ["0", "1", "2"]
    assert runs[0] == {"seeds": [0, 1], "elapsed_s": info["elapsed_s"], "git_commit": info["git_commit"],
                       "torch": info["torch"], "date": None, "device": "cpu"}
    assert runs[1]["seeds"] == [2] and runs[1]["elapsed_s"] == 2.5
    assert "inconclusive at 3 seeds" in merged.table or "reproduced" in merged.table or "opposite" in merged.table


def test_merge_rules_and_conflicts():
    old = {"a": {"0": {"x": 1.0}, "n": 4}, "lists": {"64": [1, 2]}, "lengths": [32, 64]}
    new = {"a": {"1": {"x": 2.0}, "n": 4}, "lists": {"64": [3]}, "lengths": [32, 64]}
    assert merge_json(old, new, 2, 1, path="raw") == {
        "a": {"0": {"x": 1.0}, "1": {"x": 2.0}, "n": 4}, "lists": {"64": [1, 2, 3]}, "lengths": [32, 64]}
    with pytest.raises(ValueError, match=r"^raw\.a\.0\.x: the old seeds' 1.0 and the new seeds' 2.0 cannot be"):
        merge_json({"a": {"0": {"x": 1.0}}}, {"a": {"0": {"x": 2.0}}}, 1, 1, path="raw")
    with pytest.raises(ValueError, match=r"^raw\.l: the old seeds' \[1, 2, 3\]"):  # not one entry per seed
        merge_json({"l": [1, 2, 3]}, {"l": [4]}, 2, 1, path="raw")
    with pytest.raises(ValueError, match=r"^settings\.lengths: "):  # settings' lists are never per seed
        merge_json({"lengths": [1]}, {"lengths": [2]}, 1, 1, path="settings", per_seed_lists=False)
    with pytest.raises(ValueError, match=r"^raw\.a: the old seeds' \{\"0\": 1\} and the new seeds' 2 "):
        merge_json({"a": {"0": 1}}, {"a": 2}, 1, 1, path="raw")
    assert merge_json({"device": "cpu", "k": 1}, {"device": "cuda", "k": 1}, 1, 1, path="settings",
                      keep_old=("device",)) == {"device": "cpu", "k": 1}


def test_merge_seeds_refuses_overlap_and_another_study(two_seed_run):
    info = json.loads((two_seed_run("mla") / "results.json").read_text())
    with pytest.raises(ValueError, match=r"^seeds: the new seeds \[1\] overlap the old \[0, 1\]"):
        merge_seeds(info, StudyResult("mla", "", {}, {}, [1], lambda p: None), elapsed_s=1.0)
    with pytest.raises(ValueError, match=r"^study: the old results are 'mla', the new seeds 'dsa'"):
        merge_seeds(info, StudyResult("dsa", "", {}, {}, [2], lambda p: None), elapsed_s=1.0)
    with pytest.raises(ValueError, match=r"^raw\.GQA-8\.0\.val_loss: "):  # seed 0's numbers again, other values
        merge_seeds(info, StudyResult("mla", "", {"GQA-8": {"0": {"val_loss": -1.0}}}, {}, [2], lambda p: None),
                    elapsed_s=1.0)


def test_summary_reads_an_extended_folder(extended, tmp_path):
    """The summary row names both runs' commits and the summed time."""
    def default_size(info):
        info.update(quick=False, settings={**info["settings"], "scale": "cpu"})
        info["runs"][0]["git_commit"] = "abcdef0" + "1" * 33
        info["elapsed_s"] = 600.0

    copy_of(extended("mla"), tmp_path / "root", default_size)
    line = next(ln for ln in summary_table(load_results(tmp_path / "root")).splitlines() if ln.startswith("| `mla`"))
    commit = json.loads((extended("mla") / "results.json").read_text())["git_commit"][:7]
    assert line.startswith(f"| `mla` [2] (abcdef0 / {commit}")
    assert ", 10 min) |" in line


def test_hand_edited_results_and_nonsense_seeds_are_refused_in_one_line(tmp_path):
    """Found by the issue-40 attack: each of these was a traceback, or ran and wrote a wrong table."""
    from glm5lab.ablate.runner import check_extension, check_out

    with pytest.raises(ValueError, match=r"^--seeds = 100000000000000000000 is not allowed: at most 1000$"):
        StudyArgs("dsa", quick=True, seeds=10**20)  # was OverflowError from range() after the lock was taken
    good = {"study": "dsa", "quick": True, "seeds": [0], "settings": {"scale": "quick"}, "raw": {"a": {"0": 1.0}}}
    path = tmp_path / "results.json"
    cases = [({"raw": {}}, "raw is {}, a non-empty object expected"),
             ({"settings": 5}, "settings is 5, a non-empty object expected"),
             ({"seeds": []}, "seeds is [], a non-empty list expected"),
             ({"seeds": "0"}, 'seeds is "0", a non-empty list expected'),
             ({"quick": "no"}, "quick is 'no', true or false expected")]
    runs = "a list of objects with seeds (a list) and elapsed_s (a number) expected"  # these failed after the run
    cases += [({"runs": 5}, f"runs is 5, {runs}"), ({"runs": "ab"}, f'runs is "ab", {runs}'),
              ({"runs": [{"seeds": [0], "elapsed_s": "x"}]}, f'runs is [{{"seeds": [0], "elapsed_s": "x"}}], {runs}')]
    for edit, message in cases:
        path.write_text(json.dumps(good | edit))
        with pytest.raises(ValueError) as e:
            check_out(tmp_path, extend=True)
        assert str(e.value) == f"{path}: {message}; cannot extend it"
    path.write_text(json.dumps(good))
    args = StudyArgs("dsa", quick=True, seeds=2, out=str(tmp_path))
    assert check_extension(args, check_out(tmp_path, extend=True), path) == 1
    path.unlink()
    path.mkdir()  # was: the whole study ran, then failed to rename its results.json over the folder
    with pytest.raises(ValueError) as e:
        check_out(tmp_path, extend=True)
    assert str(e.value) == f"--out {tmp_path}: results.json is not a file; remove it or pick another --out"
