"""How often DSA's top-k is decided by a tie: the share of query rows whose k-th and (k+1)-th
index scores are exactly equal (issue 11).

At such a row the selection rule, not the model, picks the last key (glm5lab: the earlier key;
transformers' torch.topk: unspecified), so implementations may legitimately differ there. A score
is exactly 0 when every indexer head's ReLU is 0, so models with few indexer heads tie often.

For each model (trained run folders / checkpoints given with --model, and random inits of a
preset with --random-preset at each --index-heads count), the forward runs over --prompts held-out
windows of --prompt-len tokens (the run's validation split: `glm5lab.data.pipeline.held_out_prompts`,
as in benchmarks/speculative.py; random models read the first --model's windows, or seeded random ids without one), and
every full indexer layer's scores are checked row by row (rows with more than index_topk causal
keys only: below that every key is selected).

    .venv/bin/python benchmarks/index_ties.py --model runs/small                  # the default run
    .venv/bin/python benchmarks/index_ties.py --model A --model B --random-preset small --index-heads 4,16

Prints a markdown table, then one JSON line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, print_json_line, resolve_checkpoint

import glm5lab.model.mla as mla
from glm5lab import GLM5ForCausalLM, ModelConfig
from glm5lab.environment import env_facts
from glm5lab.model.topk import boundary_ties
from glm5lab.data.pipeline import held_out_prompts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", default=[], help="run folder or checkpoint (repeatable)")
    p.add_argument("--random-preset", default=None, help="also measure random inits of this preset")
    p.add_argument("--index-heads", default="4,16", help="index_n_heads values of the random inits")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--data", default=None, help="corpus (default: the run's)")
    p.add_argument("--split-seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    args.heads = [int(h) for h in args.index_heads.split(",") if h]
    if not args.model and not args.random_preset:
        p.error("give at least one --model or --random-preset")
    return args


def count_ties(scores_BTS: torch.Tensor, k: int) -> tuple[int, int, int]:
    """(rows with more than k causal keys, of which tied at the k-th place, of which at score 0)."""
    rows = scores_BTS.isfinite().sum(-1) > k
    tie = boundary_ties(scores_BTS, k)
    kth = scores_BTS.topk(min(k, scores_BTS.shape[-1]), dim=-1).values[..., -1]
    return int(rows.sum()), int(tie.sum()), int((tie & (kth == 0)).sum())


def measure(model, prompts: list[list[int]]) -> list[dict]:
    """Per full indexer layer (in call order): rows, tie rows, zero-score tie rows."""
    seen, original = [], mla.select_topk

    def record(scores, k, **kw):
        seen.append(count_ties(scores, k))
        return original(scores, k, **kw)

    mla.select_topk = record
    try:
        with torch.no_grad():
            model(torch.tensor(prompts))
    finally:
        mla.select_topk = original
    return [{"layer_call": i, "rows": r, "ties": t, "zero_ties": z} for i, (r, t, z) in enumerate(seen)]


def summary(name: str, cfg: ModelConfig, layers: list[dict]) -> dict:
    rows, ties, zero = (sum(d[key] for d in layers) for key in ("rows", "ties", "zero_ties"))
    return {"model": name, "index_n_heads": cfg.index_n_heads, "index_topk": cfg.index_topk, "rows": rows,
            "tie_rows": ties, "tie_fraction": ties / rows if rows else 0.0, "zero_score_ties": zero,
            "per_layer_fraction": [round(d["ties"] / d["rows"], 4) if d["rows"] else 0.0 for d in layers]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results, data_info, prompts = [], None, None
    for path in args.model:
        checkpoint = resolve_checkpoint(Path(path))
        model = GLM5ForCausalLM.from_pretrained(checkpoint).eval()
        ps, info = held_out_prompts(checkpoint, args.prompts, args.prompt_len, data=args.data,
                                    split_seed=args.split_seed)
        prompts, data_info = prompts or ps, data_info or info
        results.append(summary(str(path), model.config, measure(model, ps)))
    if args.random_preset:
        for heads in args.heads:
            cfg = ModelConfig.from_preset(args.random_preset, index_n_heads=heads)
            torch.manual_seed(0)
            model = GLM5ForCausalLM(cfg).eval()
            ps = prompts or torch.randint(0, cfg.vocab_size, (args.prompts, args.prompt_len),
                                          generator=torch.Generator().manual_seed(0)).tolist()
            results.append(summary(f"{args.random_preset} random init", cfg, measure(model, ps)))
    rows = [[r["model"], r["index_n_heads"], r["index_topk"], r["rows"], r["tie_rows"], f"{r['tie_fraction']:.2%}",
             r["zero_score_ties"], " / ".join(f"{x:.1%}" for x in r["per_layer_fraction"])] for r in results]
    print(markdown_table(["model", "indexer heads", "index_topk", "query rows", "tie rows", "tie share",
                          "at score 0", "per full layer"], rows))
    record = {"benchmark": "index_ties", "results": results, "prompts": args.prompts, "prompt_len": args.prompt_len,
              "data": data_info, "env": env_facts(torch.device("cpu"))}
    print_json_line(record)
    return record


if __name__ == "__main__":
    main()
