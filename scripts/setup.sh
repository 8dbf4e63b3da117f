#!/usr/bin/env bash
# Create .venv and install spotune with the right torch for this machine. Idempotent: a second
# run on a .venv nothing changed since its last check ends at once (`checked` below); after any
# change it checks again. Called by `make demo` (the runtime) and `make test` (EXTRAS=test,bench).
#   - torch already importable in .venv: kept as it is.
#   - otherwise scripts/torch_choice.py decides, and says why in one line:
#       a torch in the Python that runs this (PYTHON: a venv, a conda env or the system's) that
#       satisfies pyproject.toml (and, on a GPU machine, sees the GPU)
#                                -> .venv sees that environment's packages: nothing downloaded
#       no GPU                   -> the CPU build (never the several GB of CUDA packages)
#       a GPU, no usable torch   -> the CUDA build the driver supports (nvidia-smi's CUDA Version)
#   - WHEELS=dir: install everything from that wheel folder only (air-gapped clusters; fill it
#     with scripts/fetch_wheels.sh on a machine with a network).
# After installing: if nvidia-smi sees a GPU but torch does not, stop with the reason and the fix.
# Overrides: TORCH_SPEC (the CPU build, default torch==2.13.0), TORCH_CPU_INDEX, EXTRAS (default: the
# runtime alone, plus `gpu` where a GPU answers nvidia-smi).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if [ -z "${EXTRAS+set}" ]; then
  EXTRAS=""
  # Liger's fused loss is the default loss on CUDA: a GPU machine gets it; a CPU one does not need Triton.
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then EXTRAS=gpu; fi
fi
WHEELS=${WHEELS:-}

pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
local_only=()
# Offline, pip cannot fetch setuptools into an isolated build: the venv's own (or the wheel folder's) builds it.
[ -z "$WHEELS" ] || local_only=(--no-index --find-links "$WHEELS")

# What the last full check saw: .venv's Python, every site folder it reads with when each last changed
# (an install, upgrade or removal changes its folder), pyproject.toml, the extras, the GPUs nvidia-smi
# lists. Equal now: nothing to install and the imports checked already (about 9 s of CPU saved on
# every `make test`); `spotune train` applies the GPU rule of the check below at every start anyway.
checked="$VENV/.spotune-checked"
fingerprint() {
  "$VENV/bin/python" - "$EXTRAS" <<'PYEOF'
import os, sys
sites = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
print(sys.version.split()[0], sys.argv[1] or "runtime", os.stat("pyproject.toml").st_mtime_ns)
print(*(f"{p}@{os.stat(p).st_mtime_ns}" for p in sites), sep="\n")
PYEOF
  if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L 2>/dev/null || true; fi
}
if [ -x "$VENV/bin/python" ] && [ -f "$checked" ] && [ "$(fingerprint 2>/dev/null)" = "$(cat "$checked")" ]; then
  echo "setup: $VENV unchanged since its last check (rm $checked to check again)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  eval "$("$PY" scripts/torch_choice.py --system-python "$PY" --cpu-spec "$TORCH_SPEC")"
  echo "setup: torch: $CHOICE ($WHY)"
  if [ "$CHOICE" = system ]; then
    # --system-site-packages alone shows .venv the packages of $PY's BASE interpreter: where $PY is
    # itself a venv (a GPU image's python3 often is) its torch would be hidden. So .venv also lists
    # every site folder $PY reads, in $PY's order, after its own. Its pip is $PY's where $PY has one
    # (an ensurepip'd setuptools of its own would shadow the environment's, and need a download to build).
    if [ ! -x "$VENV/bin/python" ]; then
      without_pip=()
      "$PY" -m pip --version >/dev/null 2>&1 && without_pip=(--without-pip)
      "$PY" -m venv --system-site-packages "${without_pip[@]}" "$VENV"
    fi
    site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    "$PY" -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
      > "$site/spotune-environment.pth"
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

extras_tag=${EXTRAS:-runtime}
stamp="$VENV/.spotune-installed-${extras_tag//,/-}"
target=.
[ -z "$EXTRAS" ] || target=".[$EXTRAS]"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing spotune${EXTRAS:+[$EXTRAS]} and its dependencies"
  # Build with the environment's own setuptools where it is recent enough: nothing to download.
  isolation=()
  if "$VENV/bin/python" -c "import sys, setuptools, wheel; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)" \
    2>/dev/null; then
    isolation=(--no-build-isolation)
  fi
  if [ -n "$WHEELS" ]; then
    [ ${#isolation[@]} -gt 0 ] || pip install "${local_only[@]}" setuptools wheel
    pip install "${local_only[@]}" --no-build-isolation -e "$target"
  else
    pip install "${isolation[@]}" -e "$target"
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
fingerprint > "$checked"
