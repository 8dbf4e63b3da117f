#!/usr/bin/env bash
# Build .venv-floor: spotune with the LOWEST transformers, peft and accelerate that
# pyproject.toml allows, so `make test-floor` proves the floors are true (a
# model/loss/attention path that only works on recent releases must raise the floor).
# Idempotent: a second run with an unchanged pyproject.toml only checks.
#   FLOOR_VENV  where to build it (default .venv-floor)
#   TORCH_SPEC  the torch build (default torch==2.13.0, found in the local wheel directory
#               or on the CPU index, never the multi-GB CUDA default)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FLOOR_VENV:-.venv-floor}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

# The floors, read from pyproject.toml so they are written down once: "name>=X" -> "name==X".
floors=$("$PY" - <<'PYEOF'
import re
text = open("pyproject.toml").read()
for name in ("transformers", "peft", "accelerate"):
    m = re.search(rf'"{name}>=([0-9.]+)', text)
    if not m:
        raise SystemExit(f"scripts/floor_env.sh: no '{name}>=X' lower bound in pyproject.toml")
    print(f"{name}=={m.group(1)}")
PYEOF
)

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  pip install "$TORCH_SPEC" || pip install "$TORCH_SPEC" --extra-index-url "$TORCH_CPU_INDEX"
fi
stamp="$VENV/.spotune-floor"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "floor_env: installing spotune[test] with" $floors
  # shellcheck disable=SC2086
  pip install -e ".[test]" $floors
  touch "$stamp"
fi
"$VENV/bin/python" -c "import torch, transformers, peft, accelerate; print(f'floor_env: torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, accelerate {accelerate.__version__}')"
