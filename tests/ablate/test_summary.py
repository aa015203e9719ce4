"""The summary table (README, docs/ablations.md, report) is generated from results.json alone:
every study's `readme_row` re-judges its raw seeds and says exactly what its own table says;
`glm5lab ablate summary` rewrites only the marked block and refuses what it cannot use."""

import json
import shutil

import pytest

from glm5lab.ablate.summary import BEGIN, END, load_results, replace_block, row, summary_table, write_summary
from glm5lab.cli import main

STUDIES = ("mla", "dsa", "swa", "efficient", "mtp", "indexcache", "baseline", "optimizer")


@pytest.fixture(scope="module")
def root(tmp_path_factory, two_seed_run):
    """Quick runs of every study with 2 seeds (so each comparison has an interval; conftest's `two_seed_run`),
    copied into runs/ablate/STUDY with quick=False and scale "cpu" in results.json (as a default-size run)."""
    out = tmp_path_factory.mktemp("ablate")
    for study in STUDIES:
        shutil.copytree(two_seed_run(study), out / study)
        path = out / study / "results.json"
        info = json.loads(path.read_text())
        path.write_text(json.dumps({**info, "quick": False, "settings": {**info["settings"], "scale": "cpu"}}))
    return out


def test_each_row_repeats_its_own_tables_verdicts(root):
    infos = load_results(root)
    assert list(infos) == list(STUDIES)
    for study, info in infos.items():
        r = row(info)
        assert set(r) == {"paper", "ours", "verdict"} and all(r.values()), study
        table = (root / study / "table.md").read_text()
        for part in r["verdict"].split("; "):
            judged = part.split(": ", 1)[1]  # the interval and verdict, exactly as the study printed it
            assert judged in table, (study, judged)
            assert any(v in judged for v in ("reproduced", "opposite", "inconclusive at 2 seeds")), judged


def test_table_lists_every_study_with_its_seeds(root):
    text = summary_table(load_results(root))
    lines = [ln for ln in text.splitlines() if ln.startswith("| `")]
    assert [ln.split("`")[1] for ln in lines] == list(STUDIES)
    assert all("[2]" in ln for ln in lines)
    with pytest.raises(ValueError, match="no study results"):
        summary_table({})


def test_write_summary_replaces_only_the_block(root, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    docs = tmp_path / "ablations.md"
    docs.write_text(f"{BEGIN}{END}")
    table = write_summary(root, [readme, docs])
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n" + BEGIN) and text.endswith(END + "\nafter\n")
    assert "old table" not in text and table.strip() in text and table.strip() in docs.read_text()
    assert not list(tmp_path.glob("*.tmp"))
    assert main(["ablate", "summary", "--root", str(root), "--write", str(readme)]) == 0


def test_a_study_missing_from_root_keeps_its_row(root, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(root / "mla", partial / "mla")
    readme = tmp_path / "README.md"
    old_row = "| `dsa` [3] (abc1234, 11 min) | paper dsa | ours dsa | verdict dsa |"
    stale = "| `mla` [1] (0000000, 1 min) | old | old | old |"
    readme.write_text(f"x\n{BEGIN}\n| study [seeds] (commit, time) | paper | ours | verdict |\n|---|---|---|---|\n"
                      f"{stale}\n{old_row}\n| `nosuch` [1] (x, 1 min) | a | b | c |\n{END}\n")
    table = write_summary(partial, [readme])
    lines = [ln for ln in table.splitlines() if ln.startswith("| `")]
    assert len(lines) == 2 and lines[0].startswith("| `mla` [") and lines[0] != stale and lines[1] == old_row
    assert table.strip() in readme.read_text() and "nosuch" not in readme.read_text()
    readme.write_text(readme.read_text().replace(lines[1], "| `dsa` [3] (x) | a | b | c | d |"))
    with pytest.raises(ValueError, match=r"the ablations row of 'dsa' has 5 cells, not 4"):
        write_summary(partial, [readme])


def test_bad_inputs_are_refused_before_writing(root, tmp_path):
    with pytest.raises(ValueError, match="needs exactly one"):
        replace_block("no markers", "x", where="README.md")
    with pytest.raises(ValueError, match="README.md: needs exactly one"):
        replace_block(f"{END}{BEGIN}", "x", where="README.md")
    bad = tmp_path / "bad"
    shutil.copytree(root / "mla", bad / "mla")
    (bad / "mla" / "results.json").write_text(json.dumps({"study": "mla", "quick": True}))
    with pytest.raises(ValueError, match="not the default-size 'mla' run"):
        load_results(bad)
    (bad / "mla" / "results.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_results(bad)
    readme = tmp_path / "README.md"
    readme.write_text("no markers here")
    with pytest.raises(ValueError, match="needs exactly one"):
        write_summary(root, [readme])
    assert readme.read_text() == "no markers here"


def test_report_section_is_the_same_table(root):
    """`glm5lab report`'s ablation section opens with the same generated table (quick and gpu-scale
    runs left out); a results.json it cannot judge says so instead of failing the report."""
    from glm5lab.report.render import ablation_summary

    infos = load_results(root)
    found = {**infos, "mla (--quick)": {**infos["mla"], "quick": True}}
    assert summary_table(infos) in ablation_summary(found)
    assert "Summary not available: ValueError: study 'mla': cannot summarise it (KeyError: 'raw')" in \
        ablation_summary({"mla": {"study": "mla", "seeds": [0]}})
    assert ablation_summary({}) == ""


def _copy(root, tmp_path, study="mtp", edit=None):
    out = tmp_path / "root"
    shutil.copytree(root / study, out / study)
    if edit:
        path = out / study / "results.json"
        info = json.loads(path.read_text())
        edit(info)
        path.write_text(json.dumps(info))
    return out


def test_refuses_runs_and_roots_it_cannot_use(root, tmp_path, capsys):
    gpu = _copy(root, tmp_path, edit=lambda d: d["settings"].update(scale="gpu"))
    with pytest.raises(ValueError, match="scale='gpu', not the default-size 'mtp' run"):
        load_results(gpu)
    with pytest.raises(ValueError, match="--root .*nope: no such folder"):
        load_results(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: no STUDY/results.json"):
        load_results(tmp_path / "empty")
    (tmp_path / "list" / "mtp").mkdir(parents=True)
    (tmp_path / "list" / "mtp" / "results.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="a JSON object .* got list"):
        load_results(tmp_path / "list")
    shutil.rmtree(gpu)
    broken = _copy(root, tmp_path, edit=lambda d: d.pop("raw"))
    readme = tmp_path / "R.md"
    readme.write_text(f"{BEGIN}{END}")
    assert main(["ablate", "summary", "--root", str(broken), "--write", str(readme)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("glm5lab ablate: error: ") and "mtp/results.json: cannot summarise it (KeyError" in err
    assert "\n" not in err
    assert main(["ablate", "summary", "--seeds", "2", "--root", str(broken), "--write", str(readme)]) == 2
    assert "--seeds: not used by `glm5lab ablate summary`" in capsys.readouterr().err
    assert main(["ablate", "mtp", "--root", str(broken)]) == 2
    assert "--root / --write are for `glm5lab ablate summary`" in capsys.readouterr().err


def test_writes_are_all_or_nothing_and_keep_the_file(root, tmp_path, monkeypatch):
    import tempfile

    one = _copy(root, tmp_path)
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_bytes(f"x\r\n{BEGIN}\r\nold\r\n{END}\r\nend\r\n".encode())
    a.chmod(0o600)
    b.write_text(f"{BEGIN}{END}")
    real_mkstemp = tempfile.mkstemp

    def full_disk(*args, prefix="", **kwargs):  # the second temporary file cannot be written
        if prefix.startswith(".b.md"):
            raise OSError(28, "No space left on device")
        return real_mkstemp(*args, prefix=prefix, **kwargs)

    with monkeypatch.context() as mp:
        mp.setattr(tempfile, "mkstemp", full_disk)
        with pytest.raises(OSError, match="No space left"):
            write_summary(one, [a, b])
    assert b"old" in a.read_bytes() and not list(tmp_path.glob(".a.md.*"))
    link = tmp_path / "link.md"
    link.symlink_to(b)
    write_summary(one, [a, link])
    text = a.read_bytes().decode()
    assert "old" not in text and text.count("\r\n") == text.count("\n") and (a.stat().st_mode & 0o777) == 0o600
    assert link.is_symlink() and "`mtp` [2]" in b.read_text()


@pytest.mark.parametrize("study", STUDIES)
def test_every_study_re_renders_its_table_from_results_json(study, two_seed_run):
    """`result(raw, settings, seeds)` from the parsed results.json gives the table and notes the run wrote (what
    `glm5lab ablate STUDY --seeds N` re-renders after merging seeds)."""
    from glm5lab.ablate.runner import study_module

    module = study_module(study)
    folder = two_seed_run(study)
    info = json.loads((folder / "results.json").read_text())
    again = module.result(info["raw"], info["settings"], info["seeds"])
    text = (folder / "table.md").read_text()
    assert again.table.rstrip() in text and again.notes == info["notes"]
    again.plot(folder.parent / "again.png")
    assert (folder.parent / "again.png").stat().st_size > 1000


def test_the_recorded_folders_still_summarise_and_re_render():
    """benchmarks/results/ablate holds the recorded default runs the README's rows come from; this code must still
    read them (`--seeds N` extends copies of them)."""
    from pathlib import Path

    from glm5lab.ablate.runner import study_module

    infos = load_results(Path(__file__).parents[2] / "benchmarks" / "results" / "ablate")
    assert set(infos) >= {"baseline", "efficient", "indexcache", "optimizer"}
    table = summary_table(infos)
    for study, info in infos.items():
        assert f"`{study}` [{len(info['seeds'])}]" in table
        again = study_module(study).result(info["raw"], info["settings"], info["seeds"])
        assert again.notes == info["notes"]
