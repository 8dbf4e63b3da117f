#!/usr/bin/env bash
# Fill a wheel folder for a machine without a network (an air-gapped cluster, a GPU box), so that
# `WHEELS=DIR make setup` there installs from DIR alone:
#   scripts/fetch_wheels.sh DIR [PYTHON_VERSION=3.12] [TORCH=none] [EXTRAS=gpu]
# TORCH=none (the default): the target's environment has torch (a GPU image does; set-up reuses
# it), so no torch, triton or nvidia-* wheel is fetched, nor any package only they need
# (scripts/gpu_carry.py walks the requirements). TORCH=cu128 or cu130: that CUDA build of torch
# too, with everything it needs (gigabytes), for a machine without one.
# Run it on a machine with the network; copy DIR over with the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: scripts/fetch_wheels.sh DIR [PYTHON_VERSION] [TORCH=none|cu128|cu130] [EXTRAS]}
PYV=${2:-3.12}
BUILD=${3:-none}
EXTRAS=${4:-gpu}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
if [ "$BUILD" = none ]; then
  echo "fetch_wheels: spotune[$EXTRAS]'s dependencies for Python $PYV, without torch's (the target has torch)"
  "$PY" scripts/gpu_carry.py --wheels "$DIR" --extras "$EXTRAS" --python "$PYV"
  "$PY" -m pip wheel -q --no-deps -w "$DIR" .
  echo "fetch_wheels: $(find "$DIR" -name '*.whl' | wc -l) wheels in $DIR; on the target: WHEELS=$DIR make setup"
  exit 0
fi
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# The requirements, read from pyproject.toml so they are written down once.
reqs=$("$PY" - "$EXTRAS" <<'PYEOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = [r for r in project["dependencies"] if not r.startswith("torch")] + ["setuptools>=68", "wheel"]
for extra in sys.argv[1].split(","):
    wanted += project["optional-dependencies"].get(extra, [])
print("\n".join(wanted))
PYEOF
)
echo "fetch_wheels: torch ($BUILD) for Python $PYV into $DIR"
"$PY" -m pip download -q -d "$DIR" --only-binary=:all: --python-version "$PYV" "${platforms[@]}" \
  --index-url "https://download.pytorch.org/whl/$BUILD" --extra-index-url https://pypi.org/simple "torch>=2.11"
echo "fetch_wheels: spotune[$EXTRAS]'s dependencies"
mapfile -t requirements <<<"$reqs"
"$PY" -m pip download -q -d "$DIR" --only-binary=:all: --python-version "$PYV" "${platforms[@]}" "${requirements[@]}"
"$PY" -m pip wheel -q --no-deps -w "$DIR" .
echo "fetch_wheels: $(find "$DIR" -name '*.whl' | wc -l) wheels in $DIR; on the target: WHEELS=$DIR make setup"
