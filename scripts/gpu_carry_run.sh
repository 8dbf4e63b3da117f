#!/usr/bin/env bash
# The GPU check on a machine whose python3 already has CUDA torch, without a network. `make gpu-carry`
# copies this file to .gpu-carry/run.sh beside the wheels and data it installs; from the repository root:
#   bash .gpu-carry/run.sh                    set-up, then every part, each under its cap (480 s in all)
#   bash .gpu-carry/run.sh --slice longest    set-up, then one slice (a second command, under 3 minutes)
#   bash .gpu-carry/run.sh --plan             the parts, their caps and what each proves
# The wheels go into that python3 itself (no venv inside its venv); the report is
# runs/gpu-check/gpu-check.md and .json, copied into $OUT after every part when OUT is set.
set -uo pipefail
carry=$(cd "$(dirname "$0")" && pwd)
cd "$carry/.." || exit 1
exec "${PYTHON:-python3}" scripts/gpu_check.py --carry "$carry" --out "${GPU_CHECK_OUT:-runs/gpu-check}" "$@"
