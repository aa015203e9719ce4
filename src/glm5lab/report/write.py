"""Collect, measure, plot, render: `write_report(run_dir)` -> RUN_DIR/report/report.md."""

from __future__ import annotations

import datetime
from pathlib import Path

from glm5lab.environment import environment, git_commit
from glm5lab.io_utils import atomic_write_text
from glm5lab.report import attention_costs, expert_kernels, long_context, plots
from glm5lab.report.collect import load_run
from glm5lab.report.probe import ProbeSizes, probe
from glm5lab.report.render import render


def write_report(run_dir, *, out=None, measure: bool = True, quick: bool = False, compare=()) -> Path:
    """Write the report of the run in `run_dir` into `out` (default RUN_DIR/report/): report.md and its PNGs
    (written to temporary names, then renamed). measure: load the latest checkpoint and time prefill/decode,
    score retrieval and MTP acceptance (about a minute for `small` on 2 CPU cores); quick: tiny measurement
    sizes (tests); compare: other run folders, shown beside this one in a "Comparison" section (a table and
    compare.png). Returns the path of report.md. Raises NotARunError (a ValueError) naming what a folder (this
    run's or a compared one's) lacks, before anything is written. With `measure`, a MoE run's report also times its
    expert kernels at the run's own shape (`glm5lab.report.expert_kernels.measure_for_report`, about 10 s)."""
    from glm5lab import ModelConfig, __version__
    from glm5lab.ledger import ledger, render as render_ledger

    rec = load_run(Path(run_dir))
    others = [load_run(Path(p), name="--compare") for p in compare]
    seen = [rec.run_dir.resolve()]
    for other in others:
        if other.run_dir.resolve() in seen:
            raise ValueError(f"--compare {other.run_dir}: that run is already in the comparison (each run once)")
        seen.append(other.run_dir.resolve())
    out = Path(out) if out else rec.run_dir / "report"
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    _copy_ablation_plots(rec, out)
    cfg = ModelConfig.from_hf(rec.checkpoint)
    probed = _measure(rec, cfg, quick) if measure else None
    pngs = {"loss": plots.loss_by_stage(rec.metrics, _tmp(out, "loss_by_stage.png"), rec.summary),
            "perplexity": plots.val_perplexity(rec.metrics, _tmp(out, "val_perplexity.png"), rec.summary),
            "load": plots.expert_load(rec.metrics, _tmp(out, "expert_load.png"), _moe_names(cfg)),
            "ep": plots.expert_parallel(rec.metrics, _tmp(out, "expert_parallel.png")),
            "retrieval": plots.retrieval(probed["retrieval"], _tmp(out, "retrieval.png")) if probed else None,
            "acceptance": plots.acceptance(probed["acceptance"], _tmp(out, "acceptance.png")) if probed else None,
            "compare": plots.compare([(str(r.run_dir), r.metrics, r.summary) for r in [rec, *others]],
                                     _tmp(out, "compare.png")) if others else None}
    curve = long_context.load_record()
    pngs["long_context"] = long_context.plot(curve, _tmp(out, long_context.PNG_NAME)) if curve else None
    kernels = expert_kernels.measure_for_report(cfg, quick=quick) if measure and _moe_names(cfg) else None
    pngs["expert_kernels"] = expert_kernels.plot(
        kernels, _tmp(out, expert_kernels.PNG_NAME), marker=expert_kernels.run_tokens_per_expert(rec.metrics),
        title=expert_kernels.report_title(kernels)) if kernels else None
    costs = attention_costs.load_record()
    pngs["attention_costs"] = attention_costs.plot(costs, _tmp(out, attention_costs.PNG_NAME)) if costs else None
    pngs = {k: _publish(p) for k, p in pngs.items()}
    if not others:  # a plain report after a --compare one: no stale comparison figure beside it
        (out / "compare.png").unlink(missing_ok=True)
    state_rows = [_state_row(ledger(cfg, dtype=d), d) for d in ("bf16", "fp32")]
    generated = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "version": __version__,
                 "git_commit": git_commit()}
    text = render(rec, render_ledger(ledger(cfg, dtype="bf16", name=str(rec.run_dir))), state_rows, probed,
                  environment(), pngs, generated, _moe_names(cfg), curve, others, costs, kernels)
    atomic_write_text(out / "report.md", text)
    return out / "report.md"


def _tmp(out: Path, name: str) -> Path:
    return out / f".tmp-{name}"


def _publish(tmp: Path | None) -> str | None:
    if tmp is None:
        return None
    final = tmp.with_name(tmp.name.removeprefix(".tmp-"))
    tmp.replace(final)
    return final.name


def _copy_ablation_plots(rec, out: Path) -> None:
    """Copy each ablation's PNG into the report folder (ablate-<study>.png), so the report moves
    as one folder; sets info["png"] to the copied name (None when the study wrote no PNG)."""
    import shutil

    for key, info in rec.ablations.items():
        src = Path(info["folder"]) / f"{info.get('study', key)}.png"
        name = f"ablate-{key.replace(' (--quick)', '-quick')}.png"
        info["png"] = _publish(shutil.copyfile(src, _tmp(out, name))) if src.is_file() else None


def _moe_names(cfg) -> list[str]:
    """Names of the `expert_load` entries of metrics.jsonl: main MoE layers, then the MTP layer's."""
    names = [f"layer {i}" for i, t in enumerate(cfg.mlp_layer_types) if t == "sparse"]
    return names + (["MTP layer"] if cfg.num_nextn_predict_layers else [])


def _state_row(d: dict, dtype: str) -> list:
    s = d["state"]
    return [dtype, s["main"]["attention_values"], s["main"]["indexer_values"], s["main"]["bytes_per_token"],
            s["mtp"]["bytes_per_token"] if s.get("mtp") else 0, f"{s['main']['bytes_for_context']:,}"]


def _measure(rec, cfg, quick: bool) -> dict:
    import torch

    from glm5lab.data.pipeline import prepare_data

    args = rec.run["args"]
    data = prepare_data(cfg.vocab_size, args["data"], args["seed"], tokenizer=args["tokenizer"],
                        checkpoint=rec.checkpoint)
    result = probe(rec.checkpoint, data.val_tokens, ProbeSizes.quick() if quick else ProbeSizes())
    return {**result, "device": "cpu", "dtype": "fp32", "threads": torch.get_num_threads()}
