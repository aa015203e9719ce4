#!/usr/bin/env bash
# One prepared GPU check of the compiled, sync-free inference steps (issue 13), under 8 minutes on
# one GPU, printing one table at the end. On a machine with an NVIDIA GPU, from the repo root:
#
#     bash scripts/gpu_check.sh            # results also land in $OUT (or a temp folder)
#
# 1. the CUDA tests (`pytest -m cuda`: marked, skipped without CUDA): no host synchronisation in
#    decode_step (torch.cuda.set_sync_debug_mode), compiled == eager tokens (fp32) and logits
#    (bf16, CUDA graphs via mode="reduce-overhead");
# 2. benchmarks/decode.py on CUDA (bf16; bench preset at random init): eager, compiled and
#    transformers at 512 and 4K context, batches 1 and 16;
# 3. a one-minute `glm5lab train --quick` model, then benchmarks/speculative.py on it (plain and
#    MTP speculative, eager and compiled, k = 3).
# Python: .venv/bin/python when set up (scripts/setup.sh), else the machine's python3 with src/
# on the path (a GPU image with torch, transformers, safetensors, tokenizers, pytest). No network
# needed: the training corpus is the cached default one ($GLM5LAB_CACHE or ~/.cache/glm5lab) when
# present, else a generated word corpus.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"; fi
OUTDIR="${OUT:-$(mktemp -d)}"
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no NVIDIA GPU here"; exit 1; }
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"

status=0
echo "== 1. CUDA tests"
timeout 200 $PY -m pytest -q -m cuda tests/infer/test_steps.py tests/infer/test_compiled.py 2>&1 | tee "$OUTDIR/tests.log" | tail -15 || status=1

echo "== 2. decode benchmark (bf16)"
timeout 200 $PY benchmarks/decode.py --device cuda --contexts 512,4096 --new-tokens 128 --repeats 2 \
    --batches 1,16 --check-tokens 16 2>&1 | tee "$OUTDIR/decode.log" | grep -v '^{' | tail -30 || status=1

echo "== 3. speculative benchmark (quick-trained model)"
RUN="$OUTDIR/run"
DATA_ARGS=()
CACHE="${GLM5LAB_CACHE:-$HOME/.cache/glm5lab}"
if ! ls "$CACHE"/shakespeare* >/dev/null 2>&1; then
    $PY - "$OUTDIR/corpus" <<'EOF'
import random, sys, pathlib
words = "the king and queen of denmark speak of love war and the sea while the fool sings".split()
d = pathlib.Path(sys.argv[1]); d.mkdir(parents=True, exist_ok=True)
rng = random.Random(0)
for i in range(8):
    (d / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(20000)))
EOF
    DATA_ARGS=(--data "$OUTDIR/corpus")
fi
timeout 150 $PY -m glm5lab train --quick --out "$RUN" "${DATA_ARGS[@]}" > "$OUTDIR/train.log" 2>&1 || { tail -5 "$OUTDIR/train.log"; status=1; }
timeout 150 $PY benchmarks/speculative.py --model "$RUN" --device cuda --prompts 2 --prompt-len 64 --new-tokens 64 \
    --draft-steps 3 --repeats 2 --no-strict 2>&1 | tee "$OUTDIR/speculative.log" | grep -v '^{' | tail -14 || status=1

echo "== summary"
$PY - "$OUTDIR" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def last_json(name):
    p = out / name
    lines = [l for l in p.read_text().splitlines() if l.startswith("{")] if p.exists() else []
    return json.loads(lines[-1]) if lines else None
rows = []
tests = (out / "tests.log").read_text().strip().splitlines()[-1:] if (out / "tests.log").exists() else ["not run"]
rows.append(("CUDA tests", tests[0] if tests else "no output"))
d = last_json("decode.log")
if d:
    for T, r in d["contexts"].items():
        rows.append((f"decode ctx {T} tok/s eager / compiled / transformers",
                     f"{r['ours_tokens_per_s']:.0f} / {r['compiled_tokens_per_s']:.0f} / {r['hf_tokens_per_s']:.0f}"
                     f" (compile {r['compile_s']:.0f} s)"))
        ct = r.get("compiled_tokens") or {}
        rows.append((f"decode ctx {T} compiled tokens == eager (bf16)",
                     "yes" if ct.get("equal") else f"no, from new token {ct.get('first_difference')}"))
    for B, r in d["batched"].items():
        ct = r.get("compiled_tokens") or {}
        same = "same tokens" if ct.get("equal") else f"tokens differ from new token {ct.get('first_difference')}"
        rows.append((f"decode batch {B} tok/s eager / compiled", f"{r['ours']['tokens_per_s']:.0f} / "
                     f"{r['compiled']['tokens_per_s']:.0f} ({same})"))
    for g in d["goals"].values():
        rows.append((f"goal: {g['what']}", f"{g['value']} ({'met' if g['met'] else 'missed' if g['met'] is not None else '-'})"))
else:
    rows.append(("decode benchmark", "FAILED (see decode.log)"))
s = last_json("speculative.log")
if s:
    for name, r in s["cases"].items():
        al = r.get("acceptance_length")
        rows.append((f"speculative {name} tok/s", f"{r['tokens_per_s']:.0f}" + (f" (acceptance {al:.2f})" if al else "")))
    rows.append(("greedy speculative == plain", str(s["greedy_equal"])))
else:
    rows.append(("speculative benchmark", "FAILED (see speculative.log / train.log)"))
w = max(len(a) for a, _ in rows)
print("| check | result |\n|---|---|")
for a, b in rows:
    print(f"| {a.ljust(w)} | {b} |")
EOF
exit $status
