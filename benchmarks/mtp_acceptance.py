"""Where MTP drafts are rejected (issue 40 item 5): the draft head's agreement with the main model, by draft
position and context length, teacher-forced (no speculative loop), for the candidate causes.

For each context length L: `--prompts` held-out windows of L tokens (`held_out_prompts`), each followed by the
main model's plain greedy continuation of `--new-tokens` tokens. On the sequence prompt + continuation:

- **train**: the training forward (`model(ids, mtp_depth=3)`): depth j's argmax at position t against the main
  model's argmax at t + j (what a speculative round accepts: the drafts must equal the main model's greedy
  tokens);
- **draft**: the cached draft path as `glm5lab.infer.steps.draft` runs it: the MTP cache holds the depth-1 state
  of every pair (h_s, x_{s+1}), s < t (`speculative_map.prefill_stream`), then depth 1 on (h_t, x_{t+1}) and the
  chained depths on (the previous depth's post-norm state, x_{t+j}), written at positions t+1, t+2; the tokens
  are the sequence's (teacher-forced), so when the earlier drafts hold this is exactly what a round computes;
- **reset**: as draft, but the chained depths' RoPE positions reset to t (training's depth j sits at t).

"cumulative j" = the fraction of positions where depths 1..j all agree (the acceptance rate at draft position j
of a round starting there); "agree j" = depth j alone. Two regions per sequence: **text** (the prompt's last
`--new-tokens` positions: held-out text) and **gen** (the greedy continuation: what acceptance measures). Each
gen position is also classed by the smallest period p <= 6 with which the continuation repeats over the
window t - 2p + 1 .. t + 4 (0 = none): where the continuation loops; and by whether its next 4 tokens
x_{t+1..t+4} copy a 4-gram that occurs earlier in the sequence (`copies`). Prints a table and a final JSON line;
one thread unless --threads.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import speculative_map as sm
from common import load_ours, markdown_table, print_json_line, resolve_checkpoint

from glm5lab import generate
from glm5lab.data.pipeline import held_out_prompts
from glm5lab.environment import load_average

DEPTHS = 3
ARMS = ("train", "draft", "reset")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="runs/small", help="run or checkpoint folder (default runs/small)")
    p.add_argument("--contexts", default="256,512,1024,2048,4064", help="prompt lengths, comma-separated")
    p.add_argument("--prompts", type=int, default=8, help="held-out windows per context")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy continuation per prompt (the gen region)")
    p.add_argument("--attention", choices=("dense", "dsa"), default="dense", help="DSA off (dense) or on")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def copied(seq: list[int], t: int) -> bool:
    """Whether seq[t+1 .. t+4] occurs as a 4-gram in seq[0 .. t]."""
    gram, hist = seq[t + 1:t + 5], seq[:t + 1]
    return any(hist[i:i + 4] == gram for i in range(len(hist) - 3))


def period(seq: list[int], t: int, longest: int = 6) -> int:
    """The smallest p <= longest with seq[i] == seq[i - p] over t - 2p + 1 .. t + 4, else 0."""
    for p in range(1, longest + 1):
        w = seq[max(0, t - 2 * p + 1):t + 5]
        if len(w) >= 2 * p + 4 and all(w[i] == w[i - p] for i in range(p, len(w))):
            return p
    return 0


@torch.no_grad()
def chain(model, stream: sm.Stream, ids_1S: torch.Tensor, t: int, *, reset: bool) -> list[int]:
    """The cached draft path's argmax at depths 1..3 from position t, teacher-forced; the MTP cache is restored."""
    mtp = stream.mtp
    saved = [{n: b[:, t:t + DEPTHS].clone() for n, b in layer.buffers.items()} for layer in mtp.states]
    full = mtp.lengths
    mtp.truncate(t)
    h, out = stream.hidden[t][None, None], []
    for j in range(DEPTHS):
        if reset and j:
            mtp.positions = lambda T, back=j: mtp.lengths[:, None] - back + torch.arange(T)
        with mtp.writing(1):
            h, logits = model.mtp_forward(h, ids_1S[:, t + 1 + j:t + 2 + j], cache=mtp)
        mtp.__dict__.pop("positions", None)
        out.append(int(logits[0, 0].argmax()))
    for layer, buffers in zip(mtp.states, saved):
        for n, v in buffers.items():
            layer.buffers[n][:, t:t + DEPTHS] = v
    mtp.lengths = full
    return out


def blank() -> dict:
    return {"positions": 0, **{f"{a}_agree": [0] * DEPTHS for a in ARMS}, **{f"{a}_cum": [0] * DEPTHS for a in ARMS},
            "loops": {}, "copies": {}}


@torch.no_grad()
def measure_context(model, checkpoint, L: int, args) -> dict:
    """Counts per region (text, gen) over the context's prompts (see the module docstring)."""
    prompts, _ = held_out_prompts(checkpoint, args.prompts, L)
    regions = {"text": blank(), "gen": blank()}
    for prompt in prompts:
        cont = generate(model, [prompt], args.new_tokens, prefill_chunk=512).tokens
        seq = prompt + [int(x) for x in (cont[0] if isinstance(cont[0], (list, torch.Tensor)) else cont)]
        ids = torch.tensor([seq])
        S, G = len(seq), args.new_tokens
        out = model(ids, mtp_depth=DEPTHS)
        main = out.logits[0].argmax(-1).tolist()
        train = [o[0].argmax(-1).tolist() for o in out.mtp_logits]
        stream = sm.prefill_stream(model, seq)
        for name, (a, b) in (("text", (L - G - 1, L - 1)), ("gen", (L - 1, S - DEPTHS - 1))):
            r = regions[name]
            for t in range(a, b):
                got = {"train": [train[j][t] for j in range(DEPTHS)],
                       "draft": chain(model, stream, ids, t, reset=False),
                       "reset": chain(model, stream, ids, t, reset=True)}
                want = [main[t + j + 1] for j in range(DEPTHS)]
                r["positions"] += 1
                for arm, g in got.items():
                    ok = True
                    for j in range(DEPTHS):
                        hit = g[j] == want[j]
                        r[f"{arm}_agree"][j] += hit
                        ok = ok and hit
                        r[f"{arm}_cum"][j] += ok
                ok = all(train[j][t] == want[j] for j in range(DEPTHS))
                for key, cls in (("loops", period(seq, t)), ("copies", int(copied(seq, t)))):
                    c = r[key].setdefault(cls, [0, 0])  # positions, all 3 training-forward depths agree
                    c[0] += 1
                    c[1] += ok
    return regions


def rows_of(results: dict) -> list[list]:
    rows = []
    for L, regions in results.items():
        for name, r in regions.items():
            n = max(r["positions"], 1)
            f = lambda key: " / ".join(f"{x / n:.2f}" for x in r[key])  # noqa: E731
            loop = sum(v[0] for p, v in r["loops"].items() if p) / n
            copy, new = r["copies"].get(1, [0, 0]), r["copies"].get(0, [0, 0])
            rows.append([L, name, r["positions"], f("train_agree"), f("train_cum"), f("draft_cum"), f("reset_cum"),
                         f"{loop:.2f}", f"{copy[0] / n:.2f}", f"{copy[1]}/{copy[0]}", f"{new[1]}/{new[0]}"])
    return rows


def main(argv=None) -> dict:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    checkpoint = resolve_checkpoint(args.model)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    base = load_ours(checkpoint, "cpu", mtp=True)
    model = sm.variant(base, use_dsa=args.attention == "dsa", max_positions=max(contexts) + args.new_tokens + 8)
    t0, load0 = time.time(), load_average()
    results = {L: measure_context(model, checkpoint, L, args) for L in contexts}
    print(f"{args.attention} attention, {args.prompts} prompts x {args.new_tokens} greedy tokens per context, "
          f"{torch.get_num_threads()} thread(s), load average {load0} -> {load_average()}, {time.time() - t0:.0f} s")
    print(markdown_table(["context", "region", "positions", "train: agree d1 / d2 / d3",
                          "train: cumulative 1 / 2 / 3", "draft: cumulative", "draft, positions reset: cumulative",
                          "in a loop (period <= 6)", "copying a 4-gram", "cumulative 3 where copying",
                          "elsewhere"], rows_of(results)))
    record = {"benchmark": "mtp_acceptance", "model": str(checkpoint), "attention": args.attention,
              "prompts": args.prompts, "new_tokens": args.new_tokens, "threads": torch.get_num_threads(),
              "load_average": [load0, load_average()], "seconds": round(time.time() - t0, 1), "pid": os.getpid(),
              "results": {str(L): {n: {**r, "loops": {str(p): v for p, v in sorted(r["loops"].items())},
                                       "copies": {str(p): v for p, v in sorted(r["copies"].items())}}
                                   for n, r in regions.items()} for L, regions in results.items()}}
    print_json_line(record)
    return record


if __name__ == "__main__":
    main()
