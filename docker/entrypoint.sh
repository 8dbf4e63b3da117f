#!/usr/bin/env bash
# Container entrypoint: `spotune train "$@"`. The train command resumes by itself from the
# newest checkpoint that verifies, so restarting the container is the whole recovery story:
#
#   docker run --gpus all --restart on-failure:5 -v $PWD/runs:/work/runs spotune RECIPE [key=value ...]
#
# The container exits with the trainer's own code (trainer/exit_codes.py; a test keeps
# these in step), so an orchestrator can decide:
# shellcheck disable=SC2034  # documentation the test reads
EXIT_FINISHED=0      # done: final/ holds the adapter; do not restart
EXIT_BAD_INPUT=2     # bad configuration or data, or store credentials lacking a permission: fix it, restarting fails the same way
EXIT_OUT_OF_MEMORY=5 # does not fit the GPU: change what the message says, restarting fails the same way
EXIT_PREEMPTED=143   # SIGTERM/SIGUSR1 or a cloud notice (checkpoint saved), or a store/hub fault of the moment: restart to resume
EXIT_BUSY=75         # another attempt holds the run (its lock or lease): do not restart now
# Kubernetes (podFailurePolicy), SLURM and SkyPilot can tell these apart (scripts/launch/);
# Docker's `--restart on-failure` restarts on every non-zero code, hence the retry cap
# `:5`, which bounds the loop a configuration error would cause (it fails in seconds).
# A replacement that finds the run held (the old VM still draining, or a lease not yet expired
# after a kill) waits up to SPOTUNE_WAIT seconds (default 300: the default lease of 180 s,
# plus margin) and then resumes; $EXIT_BUSY after that means a live writer elsewhere. Docker's
# on-failure restart then waits again, so it never trains beside the holder.
# `docker stop` sends SIGTERM: spotune saves and exits $EXIT_PREEMPTED, and Docker does not
# restart a container you stopped; give it time to save: `docker stop -t 120`.
# Single process: spotune replaces this shell (exec), so it receives the signals itself.
# Several GPUs: torchrun starts one rank per GPU and forwards SIGTERM to them, but reports
# any rank's non-zero exit as 1. So the main rank also writes its code to $SPOTUNE_EXIT_FILE
# (trainer/exit_codes.py) and this script exits with that: 143 stays 143, 2 stays 2.
set -uo pipefail
if [ "${1:-}" = "spotune" ]; then shift; fi
case "${1:-}" in
  prepare|inspect|estimate|pilot|export|config|status|report|chat) exec spotune "$@" ;;
  train) shift; exec spotune train --wait "${SPOTUNE_WAIT:-300}" "$@" ;;
esac
nproc=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
if [ "$nproc" -gt 1 ]; then
  SPOTUNE_EXIT_FILE=$(mktemp)
  export SPOTUNE_EXIT_FILE
  torchrun --standalone --nproc_per_node "$nproc" -m trainer train --wait "${SPOTUNE_WAIT:-300}" "$@" &
  launcher=$!
  trap 'kill -TERM "$launcher" 2>/dev/null' TERM INT USR1
  wait "$launcher"
  rc=$?
  while kill -0 "$launcher" 2>/dev/null; do  # a trapped signal ends `wait` early: wait for the save
    wait "$launcher"
    rc=$?
  done
  if [ -s "$SPOTUNE_EXIT_FILE" ]; then rc=$(cat "$SPOTUNE_EXIT_FILE"); fi
  rm -f "$SPOTUNE_EXIT_FILE"
  exit "$rc"
fi
exec spotune train --wait "${SPOTUNE_WAIT:-300}" "$@"
