#!/usr/bin/env bash
# Create .venv and install spotune with the right torch for this machine. Idempotent:
# a second run only checks. Called by `make demo` and `make test`.
#   - torch already importable in .venv: kept as it is.
#   - otherwise scripts/torch_choice.py decides, and says why in one line:
#       no GPU                   -> the CPU build (never the several GB of CUDA packages)
#       a GPU and a system torch that sees it and satisfies pyproject.toml
#                                -> the venv reuses it (--system-site-packages): nothing downloaded
#       a GPU, no usable torch   -> the CUDA build the driver supports (nvidia-smi's CUDA Version)
#   - WHEELS=dir: install everything from that wheel folder only (air-gapped clusters; fill it
#     with scripts/fetch_wheels.sh on a machine with a network).
# After installing: if nvidia-smi sees a GPU but torch does not, stop with the reason and the fix.
# Overrides: TORCH_SPEC (the CPU build, default torch==2.13.0), TORCH_CPU_INDEX, EXTRAS.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
EXTRAS=${EXTRAS:-test,bench}
WHEELS=${WHEELS:-}

pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
local_only=()
# Offline, pip cannot fetch setuptools into an isolated build: the venv's own (or the wheel folder's) builds it.
[ -z "$WHEELS" ] || local_only=(--no-index --find-links "$WHEELS")

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  eval "$("$PY" scripts/torch_choice.py --system-python "$PY" --cpu-spec "$TORCH_SPEC")"
  echo "setup: torch: $CHOICE ($WHY)"
  if [ "$CHOICE" = system ]; then
    [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
  else
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  fi
  if [ -n "$WHEELS" ] && [ "$CHOICE" != system ]; then
    pip install "${local_only[@]}" "${SPEC}"
  elif [ "$CHOICE" = cuda ]; then
    # torch itself from its build's index only: with PyPI beside it, the first torch release that
    # has no $BUILD wheel would come from PyPI, built for another CUDA than this driver runs.
    pip install --no-deps "$SPEC" --index-url "$INDEX"
    version=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('torch'))")
    case "$version" in
      *"+$BUILD") ;;
      *) echo "setup: installed torch $version, not a $BUILD build; install one by hand: pip install torch --index-url $INDEX" >&2
         exit 3 ;;
    esac
    # Then its dependencies; the pin (with its +$BUILD label) keeps this very build.
    pip install "torch==$version" --index-url "$INDEX" --extra-index-url https://pypi.org/simple
  elif [ "$CHOICE" = cpu ]; then
    if probe=$(mktemp -d) && pip download --no-deps --no-index -d "$probe" "$SPEC" >/dev/null 2>&1; then
      rm -rf "$probe"
      pip install "$SPEC"  # found in this machine's local wheel directory
    else
      pip install "$SPEC" --extra-index-url "$TORCH_CPU_INDEX"
    fi
  fi
fi

stamp="$VENV/.spotune-installed-${EXTRAS//,/-}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing spotune[$EXTRAS] and its dependencies"
  if [ -n "$WHEELS" ]; then
    pip install "${local_only[@]}" setuptools wheel
    pip install "${local_only[@]}" --no-build-isolation -e ".[$EXTRAS]"
  else
    pip install -e ".[$EXTRAS]"
  fi
  touch "$stamp"
fi
# trainer first: it quiets bitsandbytes' optional kernels-community notice that `import peft` triggers.
"$VENV/bin/python" - <<'PYEOF'
import sys
import trainer  # noqa: F401
import torch, transformers, peft, accelerate, datasets  # noqa: E401,F401
from trainer.training.gpu_probe import unusable_gpu_reason  # the rule `spotune train` applies too
print(f"setup: torch {torch.__version__} (cuda={torch.cuda.is_available()}), transformers {transformers.__version__}, peft {peft.__version__}")
if reason := unusable_gpu_reason():
    sys.exit(f"setup: {reason}")
PYEOF
