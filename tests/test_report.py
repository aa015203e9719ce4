"""`glm5lab report RUN_DIR`: every section of the seed's checklist is in report.md with the run's
own numbers (validation loss and bits per byte from summary.json, "not recorded" for a run
without them, state bytes equal to the ledger, throughput rows with their batch and length), the
PNGs it links exist and are PNGs, ablation results beside the run are included, and a folder that
is not a finished run is refused with one clear line. Issue 16: both validation figures with their
token counts, stage means, an expert-load caption computed from the records, probe sizes in words,
plots whose legends name quantities (not stages), and `--compare` (a table and overlaid curves).
A run folder an older glm5lab wrote (run.json without eval_tokens) is refused in one line."""

import json
import re
import shutil

import pytest

from glm5lab import ModelConfig
from glm5lab.ablate.results import markdown_table
from glm5lab.cli import main
from glm5lab.ledger import ledger
from glm5lab.report import NotARunError, load_run, write_report
from glm5lab.report.plots import plain_log_ticks
from glm5lab.report.series import load_stats
from glm5lab.train.plot import draw_losses
from glm5lab.train.loop import train
from tests.conftest import write_word_corpus
from tests.train.conftest import run_args

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
    train(run_args(root, root / "runs" / "tiny"))
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
    assert (f"**{summary['val_bits_per_byte']:.3f}** bits per byte over {summary['val_bytes']:,} UTF-8 bytes) on "
            f"the whole held-out split ({summary['val_tokens']:,} target tokens)") in text
    assert "The validation curve is a subset of that split" in text and "{'" not in text  # no raw dict
    assert "Probe sizes: throughput at batch 1 x 32 prompt tokens, batch 2 x 32 prompt tokens" in text
    cfg = json.loads((run / "config.json").read_text())
    bf16 = ledger(ModelConfig.from_hf(run / "config.json"), dtype="bf16")["state"]["main"]["bytes_per_token"]
    assert re.search(rf"\| bf16 \| \d+ \| \d+ \| {bf16} \|", text)
    assert "| 1 | 32 | 4 |" in text and "| 2 | 32 | 4 |" in text           # batch, prompt length, new tokens
    assert "mean acceptance length **" in text and "| MLA | 4.2 |" in text  # MTP probe; the ablation beside
    by_context = text[text.index("Against context"):text.index("![acceptance by draft position]")]
    assert "| prompt length | verifications | acceptance length | position 1 | position 2 | position 3 |" in by_context
    assert re.search(r"\| 16 \| \d+ \| [\d.]+ \|", by_context) and re.search(r"\| 32 \| \d+ \| [\d.]+ \|", by_context)
    assert "and after prompts of 16, 32 tokens." in text
    assert cfg["model_type"] == "glm_moe_dsa"
    for name in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text):
        if "/" in name:
            continue  # the ablation's own PNG, referenced where it lies
        data = (run / "report" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    assert {p.name for p in (run / "report").iterdir()} >= {"loss_by_stage.png", "val_perplexity.png",
                                                            "expert_load.png", "retrieval.png", "acceptance.png",
                                                            "expert_kernels.png"}
    kernels = text[text.index("### Expert kernels: share of the matmul peak"):]  # inside "Expert load"
    assert text.index("## Expert load") < text.index("### Expert kernels") < text.index("## Ablations")
    assert "at this run's expert shape (8 experts of 64 x 32)" in kernels and "| grouped (padded batch) |" in kernels
    assert "Half of the peak reached (tokens per expert):" in kernels
    assert "![expert kernels](expert_kernels.png)" in kernels
    assert not list((run / "report").glob(".tmp*"))


def test_run_without_bits_per_byte_reports_not_recorded(run, tmp_path):
    """A tokenizer that is not byte-level leaves summary.json without val_bits_per_byte / val_bytes."""
    folder = _copy(run, tmp_path / "nobpb", summary=lambda s: [s.pop(k) for k in ("val_bits_per_byte", "val_bytes")])
    summary = json.loads((folder / "summary.json").read_text())
    text = write_report(folder, measure=False).read_text()
    assert (f"Validation loss **{summary['val_loss']:.3f}** nats/token (perplexity {summary['val_perplexity']:.1f}; "
            "bits per byte: not recorded) on the whole held-out split") in text


def test_run_folder_of_an_older_version_is_refused_in_one_line(run, tmp_path, capsys):
    """Before issue 36 run.json held eval_batches (the subset counted in batches), not eval_tokens."""
    def older(info):
        info["args"].pop("eval_tokens")
        info["args"]["eval_batches"] = 2

    old = _copy(run, tmp_path / "old", run_json=older)
    with pytest.raises(NotARunError, match="run.json has no eval_tokens: an older glm5lab trained this run"):
        load_run(old)
    assert main(["report", str(run), "--no-measure", "--out", str(tmp_path / "rep"), "--compare", str(old)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glm5lab report: error: ") and "train it again" in err and err.count("\n") == 1


def test_a_run_json_that_is_no_record_and_a_compared_run_without_checkpoints_are_refused_by_name(run, tmp_path):
    bad = _copy(run, tmp_path / "bad")
    for text in ("[1, 2]", '{"args": null}'):
        (bad / "run.json").write_text(text)
        with pytest.raises(NotARunError, match=r"run.json is not a `glm5lab train` run record"):
            load_run(bad)
    bare = _copy(run, tmp_path / "bare")
    shutil.rmtree(bare / "checkpoints")
    with pytest.raises(ValueError, match=r"^RUN_DIR = .* a run folder with a completed checkpoint"):
        load_run(bare)
    with pytest.raises(ValueError, match=r"^--compare = .*bare' is not allowed"):
        write_report(run, out=tmp_path / "rep", measure=False, compare=[bare])


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


def _copy(run, dest, *, summary=None, run_json=None, row=None):
    """A copy of `run` (without its report) with `summary(dict)`, `run_json(dict)` and `row(dict)` (each
    metrics.jsonl row) applied in place to what the copy holds."""
    folder = shutil.copytree(run, dest, ignore=shutil.ignore_patterns("report"))
    for name, edit in (("summary.json", summary), ("run.json", run_json)):
        if edit:
            data = json.loads((folder / name).read_text())
            edit(data)
            (folder / name).write_text(json.dumps(data))
    if row:
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        for r in rows:
            row(r)
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_run_without_periodic_validation_has_no_curve(run, tmp_path):
    """eval_every 0: no val_loss per step, no subset figures; the report says so, and plots."""
    def no_subset(summary):
        summary.pop("val_subset_loss"), summary.pop("val_subset_tokens")
        for st in summary["stages"]:
            st["val_end"] = None

    folder = _copy(run, tmp_path / "noval", summary=no_subset,
                   row=lambda r: (r.pop("val_loss", None), r.pop("val_tokens", None)))
    text = write_report(folder, measure=False).read_text()
    assert "No periodic validation was run (eval_every 0), so there is no validation curve." in text
    assert "![loss by stage](loss_by_stage.png)" in text and "val_perplexity.png" not in text


def _as_new(run, dest):
    """A copy of `run` with every key of issue 16's contract (the values the loop would write for
    2-step means), whether or not this tree's loop writes them yet."""
    new = shutil.copytree(run, dest, ignore=shutil.ignore_patterns("report"))
    rows = [json.loads(line) for line in (new / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r.get("val_loss") is not None:
            r.setdefault("val_tokens", 2 * 2 * 24)  # eval_tokens: 4 windows of 24 targets
    (new / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((new / "summary.json").read_text())
    val = [r for r in rows if r.get("val_loss") is not None]
    summary.setdefault("val_subset_loss", val[-1]["val_loss"])
    summary.setdefault("val_subset_tokens", val[-1]["val_tokens"])
    for st in summary["stages"]:
        mine = [r[st["reported"]] for r in rows if r["stage"] == st["stage"]]
        st.update(smooth_steps=2, first=sum(mine[:2]) / 2, last=sum(mine[-2:]) / 2)
        st.setdefault("val_end", [r for r in rows if r["stage"] == st["stage"]][-1].get("val_loss"))
    (new / "summary.json").write_text(json.dumps(summary))
    return new, summary


def test_headline_gives_both_validation_figures_and_stage_means(run, tmp_path):
    new, summary = _as_new(run, tmp_path / "new")
    text = write_report(new, measure=False).read_text()
    assert (f"on the whole held-out split ({summary['val_tokens']:,} target tokens), the final model") in text
    assert (f"The validation curve is a subset of that split, the first {summary['val_subset_tokens']:,} target "
            f"tokens (eval_tokens 96), scored during training; at the last step it gives "
            f"**{summary['val_subset_loss']:.3f}**") in text and "predates" not in text
    assert "| first 2 steps (mean) | last 2 steps (mean) | validation subset at stage end |" in text
    warmup = summary["stages"][1]
    row = [["indexer_warmup", 2, f"{warmup['tokens']:,}", False, "indexer", "indexer KL (its objective)",
            warmup["first"], warmup["last"], warmup["val_end"]]]
    assert markdown_table(["x"] * 9, row).splitlines()[2] in text


def test_plots_name_quantities_not_stages(run):
    """loss.png's legend: one entry per quantity (LM, MTP mean, validation subset with its token
    count or batches, whole split, indexer KL), no stage names; the stages are boundaries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec = load_run(run)
    fig, ax = plt.subplots()
    _, labels = draw_losses(ax, rec.metrics, rec.summary)
    plt.close(fig)
    assert len(labels) == 5 and not any(st in label for label in labels for st in ("dense", "sparse", "warmup"))
    assert labels[1].startswith("MTP loss (mean of 3 depths") and labels[2].startswith("validation subset (first ")
    for lo, hi in ((81.9, 205.0), (20.0, 400.0), (1.5, 3.1)):
        ticks = plain_log_ticks(lo, hi)
        inside = [t for t in ticks if lo <= t <= hi]
        assert len(inside) >= 4 and ticks[0] <= lo and ticks[-1] >= hi, (lo, hi, ticks)


def test_expert_load_caption_states_what_the_records_show(run, tmp_path):
    """Steps 1-5 with one layer's expert 0 at n - 1 assignments and the other n - 1 experts at 1
    (max / mean = n / 2), balanced after: the caption gives each stage's median and share of
    steps under 2x, the step from which they stay under 2x and the last one above."""
    folder = shutil.copytree(run, tmp_path / "load", ignore=shutil.ignore_patterns("report"))
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    n = len(rows[0]["expert_load"][0])
    for r in rows:
        r["expert_load"] = [[n - 1 if r["step"] <= 5 and e == 0 and i == 0 else 1 for e in range(n)]
                            for i in range(len(r["expert_load"]))]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = load_stats(rows)
    assert stats["settled"] == 6 and stats["last_over"] == 5 and [s[3] for s in stats["stages"]] == [0.0, 0.5, 1.0]
    text = write_report(folder, measure=False).read_text()
    assert n >= 6 and f"dense (4 steps): median {n / 2:.2f}x, 0% of steps under 2x, at most {n / 2:.2f}x; " \
                      "indexer_warmup (2 steps): " in text
    assert "From step 6 on, at least 95% of steps are under 2x; the last step at or above it is step 5 (of 9)." \
        in text and "balances them" not in text
    # the table's balance columns at the last step: every expert at 1 (max / mean 1, CV 0), none dead in 9 steps
    assert "| MoE layer | assignments | max | min | max / mean | CV | dead experts |" in text
    assert f"| layer 1 | {n} | 1 | 1 | 1.000 | 0.000 | 0 |" in text


def test_compare_puts_a_table_and_overlaid_curves_in_the_report(run, tmp_path, capsys):
    other = shutil.copytree(run, tmp_path / "adamw", ignore=shutil.ignore_patterns("report"))
    info = json.loads((other / "run.json").read_text())
    info["args"].update(optimizer="adamw", seed=1, weight_decay=0.0)
    (other / "run.json").write_text(json.dumps(info))
    summary = json.loads((other / "summary.json").read_text())
    summary["val_loss"] += 0.25
    (other / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "rep"
    assert main(["report", str(run), "--no-measure", "--out", str(out), "--compare", str(other)]) == 0
    text = (out / "report.md").read_text()
    section = text[text.index("## Comparison"):text.index("## Training tokens")]
    assert "**The held-out splits differ** (seed not the same in every run)" in section
    head = next(line for line in section.splitlines() if line.startswith("| run |"))
    assert head.endswith("| preset | optimizer | seed | --weight-decay |")  # flags: never a clash with "steps"
    assert f"| `{other}` | {summary['val_loss']:.3f} | 0.250 |" in section and "| adamw | 1 | 0.000 |" in section
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "![runs compared](compare.png)" in text
    capsys.readouterr()
    bad = tmp_path / "rep2"
    assert main(["report", str(run), "--no-measure", "--out", str(bad), "--compare", str(other), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glm5lab report: error: ") and "has no run.json" in err and err.count("\n") == 1
    assert not bad.exists()  # refused before anything is written
    assert main(["report", str(run), "--no-measure", "--out", str(bad), "--compare", str(run)]) == 2
    assert "already in the comparison" in capsys.readouterr().err and not bad.exists()
    assert main(["report", str(run), "--no-measure", "--out", str(out)]) == 0
    assert not (out / "compare.png").exists()  # a plain report leaves no stale comparison figure


def test_expert_parallel_section_and_plot(tmp_path):
    """An --ep run's records give the report's expert-parallel paragraph (totals and medians
    recomputed by hand) and its figure; a run without them gives neither."""
    from types import SimpleNamespace

    from glm5lab.report import plots
    from glm5lab.report.render import expert_parallel_section

    rows = [{"step": s, "stage": "dense", "tokens": 100, "expert_load": [[3, 1], [2, 2]], "ep_tokens": [60, 40],
             "ep_imbalance": imb, "a2a_bytes": 2**20} for s, imb in ((1, 1.2), (2, 1.5), (3, 1.1))]
    text = expert_parallel_section(SimpleNamespace(metrics=rows), {"ep": "expert_parallel.png"})
    assert "2 EP ranks" in text and "Over 3 steps the all-to-alls moved 3.0 MiB" in text
    assert "10,486 bytes per training token" in text  # 3 MiB / 300 tokens
    assert "median 1.20x, at most 1.50x" in text and "(expert_parallel.png)" in text
    png = plots.expert_parallel(rows, tmp_path / "ep.png")
    assert png is not None and png.stat().st_size > 10_000
    plain = [{k: v for k, v in r.items() if not k.startswith(("ep_", "a2a"))} for r in rows]
    assert expert_parallel_section(SimpleNamespace(metrics=plain), {}) == ""
    assert plots.expert_parallel(plain, tmp_path / "none.png") is None


def test_report_shows_the_attention_costs_record_and_says_when_there_is_none(run, tmp_path, monkeypatch):
    from glm5lab.report import attention_costs
    from tests.conftest import attention_costs_record

    record = tmp_path / "attention_costs.json"
    record.write_text(json.dumps(attention_costs_record()))
    monkeypatch.setattr(attention_costs, "RESULT", record)
    text = write_report(run, out=tmp_path / "with", measure=False).read_text()
    assert "### Attention costs on one stack (per layer, at 64K tokens)" in text
    assert "### Expert kernels: share of the matmul peak\n\nNot measured" in text  # measure=False
    assert not (tmp_path / "with" / "expert_kernels.png").exists()
    assert "| SWA | 0.640 / 0.576 | 3.30 / 2.20 | 4.50 / 4.50 | 64 |" in text
    assert "![attention costs](attention_costs.png)" in text
    data = (tmp_path / "with" / "attention_costs.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000
    monkeypatch.setattr(attention_costs, "RESULT", tmp_path / "absent.json")
    text = write_report(run, out=tmp_path / "without", measure=False).read_text()
    assert "Not recorded (no benchmarks/results/attention_costs.json" in text
    assert not (tmp_path / "without" / "attention_costs.png").exists()


def test_report_shows_the_blimp_table_when_blimp_json_exists(run, tmp_path):
    from glm5lab.evals.blimp import Pair, load_published, summarize

    folder = _copy(run, tmp_path / "run")
    assert "## BLiMP" not in write_report(folder, measure=False).read_text()
    pairs = [Pair("anaphor_gender_agreement", "anaphor_agreement", "good", "bad")] * 2
    result = summarize(pairs, [0.0, 0.0], [-1.0, 1.0], load_published())  # one right, one wrong
    result |= {"model": "m", "prefix_token": "<|endoftext|>", "subset": None}
    (folder / "blimp.json").write_text(json.dumps(result))
    text = write_report(folder, measure=False).read_text()
    assert "## BLiMP" in text and "Overall **50.0%** (95% CI" in text
    assert "| anaphor_agreement | 1 | 50.0 (" in text and "| 43.9 | 88.2 | 91.2 | 99.4 |" in text  # published beside
    assert "Early Modern English" not in text  # this run names its corpus (--data)
    default = _copy(run, tmp_path / "default", run_json=lambda r: r["args"].update(data=None))
    (default / "blimp.json").write_text(json.dumps(result))
    assert "Early Modern English" in write_report(default, measure=False).read_text()
