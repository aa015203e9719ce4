#!/usr/bin/env bash
# One prepared GPU check of everything that matters (issues 13, 36, 39), under 9 minutes on one GPU (H100 / H200),
# printing one table at the end. On a machine with an NVIDIA GPU, from the repo root:
#
#     bash scripts/gpu_check.sh                          # results also land in $OUT (or a temp folder)
#     GPU_CHECK_CPU_SMOKE=1 bash scripts/gpu_check.sh    # the wiring: every step at tiny sizes, CPU fp32, 1 thread
#
# Steps, each under `timeout` (budget in seconds on the GPU; the sum, 515 s, plus 2 s of kill grace per step and
# the start-up and table, ~5 s, stays under 540 s). A step that fails or runs out of time makes its row FAILED / TIMEOUT and the
# script goes on.
#   1. tests   130 s  the CUDA tests (`pytest -m cuda` on every test file that marks one; skipped without CUDA):
#                     inference (no host synchronisation in decode_step, compiled == eager tokens in fp32 and
#                     logits in bf16, CUDA graphs) and training (tests/train/test_train_cuda.py: a bf16 autocast
#                     step == the fp32 step within its written tolerance, compiled training == eager in fp32
#                     and bf16);
#   2. train   135 s  benchmarks/train_step.py --cases ours,ours-compiled: the `small` preset's full training
#                     step (8 x 256, MTP, Muon Split), eager and compiled, bf16 autocast: tokens/s and MFU against
#                     the same run's bf16 matmul peak (torch.mm 8192^3);
#   3. experts  60 s  benchmarks/expert_kernels.py --quick (bf16) when the file exists (issue 39 item 5), else
#                     its row says "not present";
#   4. context  80 s  benchmarks/long_context.py --costs, bf16: prefill and decode per layer of dense MLA, DSA
#                     and DSA + IndexCache 1/4 at 32K, 64K and 128K (dense's chunked prefill up to 64K; the
#                     uncached dense forward at every length);
#   5. fp8      65 s  benchmarks/fp8_index_keys.py --skip-quality: the DSA decode step at 32K with fp32 vs fp8
#                     index keys (fp32 model), eager and compiled;
#   6. decode   45 s  benchmarks/decode.py: greedy decode at 4K context, eager / compiled (CUDA graphs) /
#                     transformers, and batch 16 (bench preset, random init, bf16).
# (The speculative-decoding step of issue 36's check was dropped for the time: its figures are in BENCHMARKS.md.)
# GPU_CHECK_CPU_SMOKE=1 runs the same steps on the CPU in fp32 at tiny sizes, one thread (the CUDA tests are
# collected and skipped), with the budgets of SMOKE_BUDGET and TORCH_COMPILE_DISABLE=1 unless set (the compiled
# cases then run eagerly: inductor's cold CPU compiles would take most of the run; the tests pin compiled ==
# eager), except the decode step, which compiles (its steps are compiled with fullgraph=True, which refuses a
# disabled dynamo; ~45 CPU s): it checks the flags, the outputs and the table, not the figures
# (tests/test_gpu_check.py runs it, marked slow). TORCH_COMPILE_DISABLE=0 GPU_CHECK_CPU_SMOKE=1 ... compiles all.
# Exit status 0 when every step that ran passed. Python: .venv/bin/python when set up (scripts/setup.sh), else
# the machine's python3 with src/ on the path (a GPU image with torch, transformers, safetensors, tokenizers,
# pytest). No network needed. The table: scripts/gpu_check_table.py (also in $OUT/table.md).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"; fi
OUTDIR="${OUT:-$(mktemp -d)}"
mkdir -p "$OUTDIR"
rm -f "$OUTDIR"/{tests,train,experts,context,fp8,decode}.{log,status,seconds} "$OUTDIR"/table.md  # a reused $OUT
export PYTHONUNBUFFERED=1
SMOKE="${GPU_CHECK_CPU_SMOKE:-0}"
declare -A BUDGET=([tests]=130 [train]=135 [experts]=60 [context]=80 [fp8]=65 [decode]=45)
declare -A SMOKE_BUDGET=([tests]=120 [train]=180 [experts]=120 [context]=120 [fp8]=120 [decode]=300)
COMPILING=()  # the smoke's decode step compiles whatever TORCH_COMPILE_DISABLE says (below)
if [ "$SMOKE" = 1 ]; then
    export OMP_NUM_THREADS=1 TORCH_COMPILE_DISABLE=${TORCH_COMPILE_DISABLE:-1}
    DEV=cpu; DT=fp32; TH=(--threads 1); COMPILING=(env TORCH_COMPILE_DISABLE=0)
    for k in "${!SMOKE_BUDGET[@]}"; do BUDGET[$k]=${SMOKE_BUDGET[$k]}; done
    echo "GPU_CHECK_CPU_SMOKE=1: every step at tiny sizes on the CPU, fp32, 1 thread, TORCH_COMPILE_DISABLE=$TORCH_COMPILE_DISABLE"
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no NVIDIA GPU here"; exit 1; }
    DEV=cuda; DT=bf16; TH=()
fi
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
echo "results in $OUTDIR"
small() { [ "$SMOKE" = 1 ] && echo "$1" || echo "$2"; }  # small SMOKE_VALUE GPU_VALUE

# run NAME CMD...: CMD under the step's budget, output in $OUTDIR/NAME.log, outcome in $OUTDIR/NAME.status
# ("ok", "FAILED (exit N)" or "TIMEOUT (N s)") and its seconds in $OUTDIR/NAME.seconds.
run() {
    local name=$1 budget=${BUDGET[$1]} t0=$SECONDS rc
    shift
    echo "== $name (budget ${budget} s)"
    timeout -k 2 "$budget" "$@" > "$OUTDIR/$name.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then echo ok; elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "TIMEOUT (${budget} s)"
    else echo "FAILED (exit $rc)"; fi > "$OUTDIR/$name.status"
    echo $((SECONDS - t0)) > "$OUTDIR/$name.seconds"
    grep -v '^{' "$OUTDIR/$name.log" | tail -n 12
    echo "-> $(cat "$OUTDIR/$name.status") in $((SECONDS - t0)) s"
}

mapfile -t CUDA_TESTS < <(grep -rl --include='test_*.py' 'pytest.mark.cuda' tests | sort)
run tests $PY -m pytest -v -p no:randomly -m cuda "${CUDA_TESTS[@]}"  # -v: one line per test as it ends

run train $PY benchmarks/train_step.py --device $DEV "${TH[@]}" --cases ours,ours-compiled \
    $(small "--quick" "--steps 2 --repeats 3 --warmup 1")

if [ -f benchmarks/expert_kernels.py ]; then
    EXTRA=()
    if grep -q -- '"--png"' benchmarks/expert_kernels.py; then EXTRA=(--png "$OUTDIR/expert_kernels.png"); fi  # not into docs/
    run experts $PY benchmarks/expert_kernels.py --device $DEV --dtype $DT --quick --json-out "$OUTDIR/expert_kernels.json" \
        "${TH[@]}" "${EXTRA[@]}"
else
    echo "== experts: benchmarks/expert_kernels.py not present"
    echo "not present" > "$OUTDIR/experts.status"
fi

run context $PY benchmarks/long_context.py --costs --device $DEV "${TH[@]}" --mixers dsa,dsa_indexcache \
    --lengths $(small 320 32768,65536,131072) --dense-cap $(small 0 65536) --reference-cap 0 \
    --decode-steps $(small 2 10) --json-out "$OUTDIR/long_context.json" --png ''

run fp8 $PY benchmarks/fp8_index_keys.py --skip-quality --device $DEV "${TH[@]}" \
    $(small "--quick --decode-context 512 --decode-steps 2" "--decode-context 32768 --decode-steps 20")

run decode "${COMPILING[@]}" $PY benchmarks/decode.py --device $DEV "${TH[@]}" \
    $(small "--quick --contexts 320 --batches 2 --new-tokens 4" "--contexts 4096 --new-tokens 64 --repeats 1 --batches 16 --check-tokens 8")

echo "== summary (total $SECONDS s)"
$PY scripts/gpu_check_table.py "$OUTDIR" "$SMOKE" | tee "$OUTDIR/table.md"
status=0
for f in "$OUTDIR"/*.status; do case "$(cat "$f")" in ok|"not present") ;; *) status=1 ;; esac; done
exit $status
