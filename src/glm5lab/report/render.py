"""The report's markdown: the seed's closing checklist (quality, training tokens, parameter counting convention,
KV and index state bytes, prefill/decode batch and length, kernel and library versions, hardware), in that order
(with the "Comparison" of `--compare` runs and BLiMP, when RUN_DIR/blimp.json exists, after quality), then expert load, ablations, evaluations, seeds."""

from __future__ import annotations

import math

from glm5lab.ablate.results import markdown_table
from glm5lab.report import compare
from glm5lab.report.blimp import render_section as blimp_section
from glm5lab.report.attention_costs import render_section as attention_costs_section
from glm5lab.report.expert_kernels import render_section as expert_kernels_section, run_tokens_per_expert
from glm5lab.report.long_context import render_section as long_context_section
from glm5lab.report.series import BALANCED, load_stats, perplexity, stage_rows
from glm5lab.train.balance import DEAD_WINDOW, balance_metrics


def render(rec, ledger_text: str, state_rows: list[list], probed: dict | None, env: dict, pngs: dict,
           generated: dict, moe_names: list[str], long_context: dict | None = None, others: list | None = None,
           attention_costs: dict | None = None, expert_kernels: dict | None = None) -> str:
    """Assemble report.md (`rec`: a RunRecord; `pngs`: name -> file name or None; moe_names: the
    names of metrics.jsonl's `expert_load` entries; long_context: the recorded long-context
    cost curve, `glm5lab.report.long_context.load_record()`, shown in the throughput section;
    others: RunRecords compared against, the "Comparison" section after Quality; attention_costs: the
    recorded mixer comparison, `glm5lab.report.attention_costs.load_record()`, shown after the curve;
    expert_kernels: the sweep at the run's expert shape, `glm5lab.report.expert_kernels.measure_for_report`,
    shown in the expert-load section, None when not measured)."""
    curve = long_context_section(long_context, pngs.get("long_context"))
    curve += attention_costs_section(attention_costs, pngs.get("attention_costs"))
    parts = [_header(rec, generated), _quality(rec, pngs), compare.section(rec, others or [], pngs.get("compare")),
             blimp_section(rec.blimp, default_corpus=rec.run.get("args", {}).get("data") is None),
             _tokens(rec), _params(ledger_text),
             _state(state_rows), _probes(probed, pngs, curve), _load(rec, pngs, moe_names, expert_kernels),
             _ablations(rec), _evals(rec), _environment(env, rec), _seeds(rec, probed)]
    return "\n".join(p for p in parts if p)


def _img(pngs: dict, key: str, alt: str) -> str:
    return f"\n![{alt}]({pngs[key]})\n" if pngs.get(key) else ""


def _header(rec, generated: dict) -> str:
    args = rec.run.get("args", {})
    return (f"# glm5lab report: `{rec.run_dir}`\n\nGenerated {generated['date']} by glm5lab {generated['version']} "
            f"(git {generated['git_commit'][:12]}). The run: preset/config `{args.get('config') or args.get('preset')}`, "
            f"trained at git {str(rec.run.get('git_commit', 'unknown'))[:12]} on {rec.run.get('device', '?')} "
            f"x {rec.run.get('world_size', 1)} process(es); latest checkpoint `{rec.checkpoint.name}`.\n")


def _quality(rec, pngs) -> str:
    return ("## Quality\n\n" + _headline(rec) + "\n\nPer stage, the stage objective at its start and end (means, "
            "less noisy than one batch) and the validation-subset loss at the stage's last step (- when none was "
            "taken).\n\n" + markdown_table(*stage_rows(rec))
            + _img(pngs, "loss", "loss by stage")
            + ("\nTop: the whole run; dotted lines mark the stage boundaries. Below: each stage on its own scale with "
               "its objective on the left axis (the indexer warm-up trains the indexer KL only; its LM loss is "
               "logged, not trained, on the right axis). Faint: every step; solid: the trailing mean.\n"
               if pngs.get("loss") else "")
            + _img(pngs, "perplexity", "validation perplexity"))


def _headline(rec) -> str:
    """The two validation figures and why they differ: summary.json's val_loss over the whole held-out split, and
    val_subset_loss, the last periodic validation over the first val_subset_tokens targets (run.json's
    eval_tokens)."""
    s = rec.summary
    whole = f" ({s['val_tokens']:,} target tokens)" if s.get("val_tokens") else ""
    text = (f"Validation loss **{s['val_loss']:.3f}** nats/token (perplexity {s['val_perplexity']:.1f}; "
            f"{_bits_per_byte(s)}) on {_val_set(s)}{whole}, the final model; the add-one unigram "
            f"baseline is {s['unigram_val_loss']:.3f}.")
    subset = s.get("val_subset_loss")
    if subset is None:
        return text + " No periodic validation was run (eval_every 0), so there is no validation curve."
    gap = s["val_loss"] - subset
    gap_text = ("" if not math.isfinite(gap) else
                f" (the whole split is {abs(gap):.3f} {'lower' if gap < 0 else 'higher'})")
    return text + (f"\n\nThe validation curve is a subset of that split, the first {s['val_subset_tokens']:,} target "
                   f"tokens (eval_tokens {rec.run['args']['eval_tokens']:,}), scored during training; at the last "
                   f"step it gives **{subset:.3f}** (perplexity {perplexity(subset):.1f}). The two figures "
                   f"differ{gap_text} because they score different text: the subset is a fixed part of the split.")


def _val_set(s: dict) -> str:
    """Which set the validation scored (summary.json's `val_set`): the held-out set the run named (`--val-data`), or
    the corpus's document split (a summary from before `val_set` was recorded: the split)."""
    held = s.get("val_set") or {}
    if held.get("kind") not in ("text", "token folder"):
        return "the whole held-out split"
    part = " (its validation split)" if held["kind"] == "token folder" else ""
    return f"the held-out set `--val-data {held['path']}`{part}, {held['documents']:,} documents"


def _bits_per_byte(s: dict) -> str:
    """summary.json's val_bits_per_byte (summed NLL / (ln 2 x UTF-8 bytes of the same targets));
    a run with a tokenizer that is not byte-level has none."""
    bpb = s.get("val_bits_per_byte")
    if bpb is None:
        return "bits per byte: not recorded"
    over = f" over {s['val_bytes']:,} UTF-8 bytes" if s.get("val_bytes") else ""
    return f"**{bpb:.3f}** bits per byte{over}"


def _tokens(rec) -> str:
    stages = rec.run.get("stages", [])
    total = sum(st.get("tokens", 0) for st in rec.summary.get("stages", []))
    rows = [[st["name"], st["steps"], st["batch_size"], st["seq_len"], st["lr"], st.get("lr_end")] for st in stages]
    return (f"## Training tokens\n\n**{total:,}** tokens in {rec.summary.get('steps')} steps "
            f"(world size {rec.run.get('world_size', 1)}; batch is per process).\n\n"
            + markdown_table(["stage", "steps", "batch", "seq_len", "lr", "lr_end"], rows))


def _params(ledger_text: str) -> str:
    return ("## Parameters under every counting convention, FLOPs\n\nFrom the config alone (`glm5lab ledger`, "
            "equal to what the instantiated model holds). The GLM-5 report counts incl. MTP, excl. embedding and "
            f"output; transformers counts incl. embedding and output, excl. MTP.\n\n```\n{ledger_text.rstrip()}\n```\n")


def _state(rows) -> str:
    return ("## KV and index state bytes per token\n\n"
            + markdown_table(["dtype", "main: attention values", "main: indexer values", "main bytes/token",
                              "MTP bytes/token", "main bytes at max context"], rows))


def _probes(probed, pngs, curve: str) -> str:
    """The throughput (with the recorded long-context curve `curve`), retrieval and MTP sections."""
    if probed is None:
        return "## Throughput, retrieval, speculative decoding\n\nNot measured (`--no-measure`).\n" + curve
    out = ["## Prefill and decode throughput\n\nGreedy `glm5lab.generate` on held-out text, one warm-up call first; "
           f"{probed['device']} in {probed['dtype']}, {probed['threads']} torch threads. Prefill includes cache "
           "writes; decode tokens/s excludes each row's first token (it comes from the prefill).\n\n"]
    rows = [[r["batch"], r["prompt_length"], r["new_tokens"], r.get("prefill_tokens_per_second"),
             r.get("decode_tokens_per_second"), r.get("skipped")] for r in probed["throughput"]]
    out.append(markdown_table(["batch", "prompt length", "new tokens", "prefill tokens/s", "decode tokens/s",
                               "skipped"], rows))
    out.append("\n" + curve)
    out.append("\n## Retrieval accuracy by context length\n\nSingle-needle NIAH in held-out text, teacher-forced "
               "exact match (= greedy generation reproduces the value). A model trained on text alone was never "
               "asked to retrieve: expect ~0 (`glm5lab ablate` trains with retrieval rows).\n\n")
    rows = [[r["context_length"], r["rows"], None if "accuracy" not in r else 100 * r["accuracy"], r.get("skipped")]
            for r in probed["retrieval"]]
    out.append(markdown_table(["context length", "examples", "exact match %", "skipped"], rows))
    out.append(_img(pngs, "retrieval", "retrieval by context length"))
    acc = probed.get("acceptance")
    out.append("\n## Speculative decoding: MTP acceptance by draft position\n\n")
    if acc is None:
        out.append("The model has no MTP layer.\n")
    elif "skipped" in acc:
        out.append(f"Skipped: {acc['skipped']}.\n")
    else:
        out.append(f"Greedy, {acc['draft_steps']} drafts per verification, {acc['rows']} held-out prompts of "
                   f"{acc['prompt_length']} tokens, {acc['new_tokens']} new tokens each ({acc['verify_steps']} "
                   f"verifications): mean acceptance length **{acc['acceptance_length']:.2f}** tokens per "
                   "verification (the report: 2.76 for GLM-5 at 4 steps, on its own prompts).\n\n")
        out.append(markdown_table(["draft position", "accepted (with all earlier)"],
                                  [[i + 1, r] for i, r in enumerate(acc["acceptance_rate"])]))
        out.append(_acceptance_by_context(probed.get("acceptance_by_context") or []))
        out.append(_img(pngs, "acceptance", "acceptance by draft position"))
    return "".join(out)


def _acceptance_by_context(rows: list[dict]) -> str:
    """The per-position acceptance against prompt length, as a table and what it measures ("" without rows)."""
    if not rows:
        return ""
    k = max((len(r["acceptance_rate"]) for r in rows if "acceptance_rate" in r), default=0)
    table = [[r["context_length"], r.get("verify_steps"), r.get("acceptance_length"),
              *(r["acceptance_rate"] if "acceptance_rate" in r else [None] * k), r.get("skipped")] for r in rows]
    return ("\nAgainst context (the same decoding after held-out prompts of each length). The drafts are "
            "checked against the model's own greedy continuation: past the length the run trained at, a small "
            "model's continuation falls into repeated phrases where the chained drafts rarely all hold, so the "
            "later positions fall first (docs/inference.md, \"Where drafts are rejected\").\n\n"
            + markdown_table(["prompt length", "verifications", "acceptance length",
                              *(f"position {i + 1}" for i in range(k)), "skipped"], table))


def _load(rec, pngs, names: list[str], kernels: dict | None = None) -> str:
    history = [r["expert_load"] for r in rec.metrics if r.get("expert_load")]
    if not history:
        return ""
    last, figures = history[-1], balance_metrics(history)
    rows = [[names[i] if i < len(names) else i, sum(layer), max(layer), min(layer), figures["load_max_mean"][i],
             figures["load_cv"][i], figures["dead_experts"][i]] for i, layer in enumerate(last)]
    return ("## Expert load\n\n" + _load_caption(rec)
            + "\n\nExpert assignments (tokens x top-k; the MTP layer's over its depths) at the last step, per MoE "
            f"layer; CV: standard deviation / mean of the experts' loads; dead: experts with no token in any of the "
            f"last {min(DEAD_WINDOW, len(history))} steps:\n\n"
            + markdown_table(["MoE layer", "assignments", "max", "min", "max / mean", "CV", "dead experts"], rows)
            + _img(pngs, "load", "expert load balance over time") + expert_parallel_section(rec, pngs)
            + expert_kernels_section(kernels, pngs.get("expert_kernels"), run_tokens_per_expert(rec.metrics)))


def expert_parallel_section(rec, pngs) -> str:
    """For an expert-parallel run (`--ep N`): what the all-to-alls moved and how evenly the EP ranks were
    loaded, from metrics.jsonl's ep_tokens / ep_imbalance / a2a_bytes; empty otherwise."""
    rows = [r for r in rec.metrics if r.get("ep_tokens")]
    if not rows:
        return ""
    total, tokens = sum(r["a2a_bytes"] for r in rows), sum(r.get("tokens") or 0 for r in rows)
    ranked = sorted(r["ep_imbalance"] for r in rows)
    per_token = f", {total / tokens:,.0f} bytes per training token" if tokens else ""
    last = rows[-1]["ep_tokens"]
    shares = ", ".join(f"{100 * n / max(sum(last), 1):.1f}%" for n in last)
    return (f"\n### Expert parallelism\n\n{len(rows[0]['ep_tokens'])} EP ranks (`--ep`). Over {len(rows)} steps "
            f"the all-to-alls moved {total / 2**20:,.1f} MiB of token rows between ranks (dispatch and combine, "
            f"forward and backward){per_token}. EP imbalance (rows the busiest EP rank received / the mean): "
            f"median {ranked[len(ranked) // 2]:.2f}x, at most {ranked[-1]:.2f}x. Share of the rows each EP rank "
            f"received at the last step: {shares}.\n"
            + _img(pngs, "ep", "expert-parallel load and all-to-all bytes"))


def _load_caption(rec) -> str:
    """What the expert_load records show (`series.load_stats`), not what the bias is meant to do."""
    stats = load_stats(rec.metrics)
    rate = rec.run.get("args", {}).get("bias_update_rate")
    per_stage = "; ".join(f"{name} ({n} steps): median {med:.2f}x, {100 * under:.0f}% of steps under "
                          f"{BALANCED:g}x, at most {top:.2f}x" for name, n, med, under, top in stats["stages"])
    if stats["last_over"] is None:
        settled = f"Every step is under {BALANCED:g}x."
    else:
        settled = (f"From step {stats['settled']} on, at least {100 * stats['share']:.0f}% of steps are under "
                   f"{BALANCED:g}x; the last step at or above it is step {stats['last_over']} (of {stats['steps']})."
                   if stats["settled"] is not None else f"It is at or above {BALANCED:g}x at the last steps.")
    return (f"The aux-loss-free bias{f' (update rate {rate})' if rate is not None else ''} lowers an over-loaded "
            "expert's routing score and raises an under-loaded one's each step. What the records show, as the "
            f"max / mean tokens per expert of the worst MoE layer at each step: {per_stage}. {settled}")


def _ablations(rec) -> str:
    if not rec.ablations:
        return ("## Ablations\n\nNone found beside the run (RUN_DIR/ablate/* or ../ablate/*); run "
                "`glm5lab ablate STUDY`.\n")
    out = ["## Ablations\n", ablation_summary(rec.ablations)]
    for key, info in rec.ablations.items():
        table = info["table"].split("\n", 1)[1] if info["table"].startswith("# ") else info["table"]
        out.append(f"\n### `{key}` ({info['folder']}, seeds {info.get('seeds')}, {info.get('elapsed_s')} s)\n"
                   f"{table.strip()}\n{_img(info, 'png', key)}")
    return "".join(out)


def ablation_summary(ablations: dict) -> str:
    """The README's summary table (`glm5lab.ablate.summary.summary_table`) of the default-size
    studies found; empty when there are none or one cannot be read."""
    from glm5lab.ablate.summary import summary_table

    full = {info["study"]: info for info in ablations.values()
            if not info.get("quick") and info.get("settings", {}).get("scale", "cpu") == "cpu"}
    if not full:
        return ""
    try:
        return "\nSummary (the README's table, generated from each results.json):\n\n" + summary_table(full)
    except (KeyError, TypeError, ValueError) as e:  # a results.json the table cannot summarise
        return f"\nSummary not available: {type(e).__name__}: {e}\n"


def _evals(rec) -> str:
    if not rec.evals:
        return ""
    out = ["## Evaluations (RUN_DIR/evals)\n"]
    for name, data in rec.evals.items():
        flat = [[k, v] for k, v in data.items() if isinstance(v, (int, float, str))]
        out.append(f"\n### {name}\n\n" + markdown_table(["field", "value"], flat))
    return "".join(out)


def _environment(env: dict, rec) -> str:
    rows = [["python", env["python"]], ["platform", env["platform"]], ["CPU", f"{env['cpu']} ({env['cpu_count']} cores)"],
            ["GPU", env["gpu"] or "none"], ["CUDA", env["cuda"] or "-"], ["torch at training", rec.run.get("torch")]]
    rows += [[name, version or "not installed"] for name, version in env["libraries"].items()]
    kernels = ("Kernels: plain PyTorch ops (no custom kernels): MLA absorbed decode and gathered top-k attention in "
               "`glm5lab.model.mla`, MoE grouped matmul in `glm5lab.model.moe`; SDPA where masks allow.\n")
    return "## Hardware, libraries and kernels\n\n" + markdown_table(["", "version / model"], rows) + "\n" + kernels


def _seeds(rec, probed) -> str:
    seed = rec.run.get("args", {}).get("seed")
    text = (f"## Seeds\n\nTraining seed {seed} (initialisation, document split, batch order). "
            "Measurements: greedy decoding (no sampling); NIAH examples with seed 0.")
    return text + ("" if probed is None else " " + _probe_sizes(probed["sizes"])) + "\n"


def _probe_sizes(sizes: dict) -> str:
    """`ProbeSizes` (as a dict) in words."""
    pairs = ", ".join(f"batch {b} x {n} prompt tokens" for b, n in sizes["throughput"])
    lengths = ", ".join(str(n) for n in sizes["retrieval_lengths"])
    return (f"Probe sizes: throughput at {pairs}, each decoding {sizes['decode_tokens']} new tokens; retrieval at "
            f"context lengths {lengths}, {sizes['retrieval_rows']} examples each; MTP acceptance with "
            f"{sizes['draft_steps']} drafts per verification on {sizes['acceptance_rows']} held-out prompts of "
            f"{sizes['acceptance_prompt']} tokens, {sizes['acceptance_tokens']} new tokens each"
            + (f", and after prompts of {', '.join(str(n) for n in sizes['acceptance_contexts'])} tokens"
               if sizes.get("acceptance_contexts") else "") + ".")
