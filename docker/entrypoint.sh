#!/usr/bin/env bash
# Container entrypoint: `spotune train "$@"`. The train command resumes by itself from the
# newest checkpoint that verifies, so restarting the container is the whole recovery story.
# Exit codes: 0 finished, 143 preempted after saving (the orchestrator should restart us),
# 2 bad configuration or input (restarting will not help).
set -uo pipefail
if [ "${1:-}" = "spotune" ]; then shift; fi
case "${1:-}" in
  prepare|inspect|estimate|pilot|export|config|train) exec spotune "$@" ;;
esac
nproc=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
if [ "$nproc" -gt 1 ]; then
  exec torchrun --standalone --nproc_per_node "$nproc" -m trainer train "$@"
fi
exec spotune train "$@"
