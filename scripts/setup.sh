#!/usr/bin/env bash
# Set up glm5lab in ./.venv. `--test` adds the test dependencies (transformers, pytest, hypothesis).
# torch: on a machine without an NVIDIA GPU, torch==2.13.0 (a CPU wheel that lies on local disk on
# the project's machines, so nothing large is downloaded); with a GPU, the regular CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  torch_spec="torch>=2.9"
else
  torch_spec="torch==2.13.0"
fi
if ! .venv/bin/python -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 9))" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check "$torch_spec"
fi
.venv/bin/pip install -q --disable-pip-version-check -e ".${extras}"
.venv/bin/python -c "import glm5lab, torch; print(f'glm5lab {glm5lab.__version__} ready (torch {torch.__version__})')"
