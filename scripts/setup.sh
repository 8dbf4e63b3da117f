#!/usr/bin/env bash
# Create .venv and install spotune with the right torch for this machine. Idempotent:
# a second run only checks. Called by `make demo` and `make test`.
#   - torch already importable in .venv: kept as it is.
#   - nvidia-smi answers: the default torch build (CUDA wheels) from the package index.
#   - otherwise: the CPU build of torch, so a CPU-only machine never downloads the
#     several GB of CUDA packages that a plain `pip install torch` pulls on Linux.
# Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0") or TORCH_CPU_INDEX.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
EXTRAS=${EXTRAS:-test,bench}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing the CUDA build of torch"
    pip install "${TORCH_SPEC%%=*}"
  elif probe=$(mktemp -d) && pip download --no-deps --no-index -d "$probe" "$TORCH_SPEC" >/dev/null 2>&1; then
    rm -rf "$probe"
    echo "setup: no GPU, installing $TORCH_SPEC from the local wheel directory"
    pip install "$TORCH_SPEC"
  else
    echo "setup: no GPU, installing the CPU build of $TORCH_SPEC"
    pip install "$TORCH_SPEC" --extra-index-url "$TORCH_CPU_INDEX"
  fi
fi

stamp="$VENV/.spotune-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing spotune[$EXTRAS] and its dependencies"
  pip install -e ".[$EXTRAS]"
  touch "$stamp"
fi
# trainer first: it quiets bitsandbytes' optional kernels-community notice that `import peft` triggers
"$VENV/bin/python" -c "import trainer, torch, transformers, peft, accelerate, datasets; print(f'setup: torch {torch.__version__} (cuda={torch.cuda.is_available()}), transformers {transformers.__version__}, peft {peft.__version__}')"
