"""`glm5lab report RUN_DIR`: every section of the seed's checklist is in report.md with the run's
own numbers (validation loss and bits per byte from summary.json, "not recorded" for an older run
without them, state bytes equal to the ledger, throughput rows with their batch and length), the
PNGs it links exist and are PNGs, ablation results beside the run are included, and a folder that
is not a finished run is refused with one clear line."""

import json
import re

import pytest

from glm5lab import ModelConfig
from glm5lab.cli import main
from glm5lab.ledger import ledger
from glm5lab.report import NotARunError, write_report
from glm5lab.train.loop import train
from tests.conftest import write_word_corpus
from tests.train.test_loop import _args

SECTIONS = ("## Quality", "## Training tokens", "## Parameters under every counting convention",
            "## KV and index state bytes per token", "## Prefill and decode throughput",
            "## Retrieval accuracy by context length", "## Speculative decoding: MTP acceptance by draft position",
            "## Expert load", "## Ablations", "## Hardware, libraries and kernels", "## Seeds")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 9-step tiny run (tests/train/test_loop.py's plan and word corpus) and an ablation beside it."""
    root = tmp_path_factory.mktemp("report")
    mp = pytest.MonkeyPatch()
    mp.setenv("GLM5LAB_CACHE", str(root / "cache"))
    write_word_corpus(root / "texts")
    (root / "config.json").write_text(json.dumps(ModelConfig.from_preset("tiny", vocab_size=320).to_hf()))
    train(_args(root, root / "runs" / "tiny"))
    study = root / "runs" / "ablate" / "mla"
    study.mkdir(parents=True)
    (study / "results.json").write_text(json.dumps({"study": "mla", "quick": False, "seeds": [0, 1, 2], "elapsed_s": 3}))
    (study / "table.md").write_text("# Ablation `mla`\n\n| variant | val loss |\n|---|---|\n| MLA | 4.2 |\n")
    yield root / "runs" / "tiny"
    mp.undo()


def test_report_holds_every_section_with_the_runs_numbers(run):
    path = write_report(run, quick=True)
    text = path.read_text()
    assert path == run / "report" / "report.md"
    for section in SECTIONS:
        assert section in text, section
    summary = json.loads((run / "summary.json").read_text())
    assert f"Validation loss **{summary['val_loss']:.3f}**" in text
    assert (f"**{summary['val_bits_per_byte']:.3f}** bits per byte over {summary['val_bytes']:,} UTF-8 bytes of "
            f"{summary['val_tokens']:,} target tokens) on the whole held-out split") in text
    cfg = json.loads((run / "config.json").read_text())
    bf16 = ledger(ModelConfig.from_hf(run / "config.json"), dtype="bf16")["state"]["main"]["bytes_per_token"]
    assert re.search(rf"\| bf16 \| \d+ \| \d+ \| {bf16} \|", text)
    assert "| 1 | 32 | 4 |" in text and "| 2 | 32 | 4 |" in text           # batch, prompt length, new tokens
    assert "mean acceptance length **" in text and "| MLA | 4.2 |" in text  # MTP probe; the ablation beside
    assert cfg["model_type"] == "glm_moe_dsa"
    for name in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text):
        if "/" in name:
            continue  # the ablation's own PNG, referenced where it lies
        data = (run / "report" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert {p.name for p in (run / "report").iterdir()} >= {"loss_by_stage.png", "val_perplexity.png",
                                                            "expert_load.png", "retrieval.png", "acceptance.png"}
    assert not list((run / "report").glob(".tmp*"))


def test_run_from_before_bits_per_byte_reports_not_recorded(run, tmp_path):
    import shutil

    old = shutil.copytree(run, tmp_path / "old", ignore=shutil.ignore_patterns("report"))
    summary = json.loads((old / "summary.json").read_text())
    for key in ("val_bits_per_byte", "val_bytes", "val_tokens"):
        del summary[key]
    (old / "summary.json").write_text(json.dumps(summary))
    text = write_report(old, measure=False).read_text()
    assert (f"Validation loss **{summary['val_loss']:.3f}** nats/token (perplexity {summary['val_perplexity']:.1f}; "
            "bits per byte: not recorded) on the whole held-out split") in text


def test_folders_that_are_not_finished_runs_are_refused_clearly(run, tmp_path, capsys):
    with pytest.raises(NotARunError, match="is not a folder"):
        write_report(tmp_path / "nope")
    with pytest.raises(NotARunError, match="has no run.json"):
        write_report(tmp_path)
    for name in ("run.json", "config.json", "metrics.jsonl"):
        (tmp_path / name).write_text((run / name).read_text())
    with pytest.raises(NotARunError, match="has not finished.*--resume"):
        write_report(tmp_path)
    (tmp_path / "summary.json").write_text("{not json")
    assert main(["report", str(tmp_path), "--no-measure"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glm5lab report: error: ") and "summary.json is not valid JSON" in err and err.count("\n") == 1


def test_report_out_on_a_file_is_refused(run, tmp_path):
    (tmp_path / "f.md").write_text("x")
    with pytest.raises(ValueError, match=r"--out .*f.md is a file, not a folder"):
        write_report(run, out=tmp_path / "f.md", measure=False)
