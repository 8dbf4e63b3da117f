#!/usr/bin/env bash
# Run spotune in its container on one VM and let Docker restart it after a preemption
# (exit 143: checkpoint saved, or a store/hub fault of the moment) or a crash; the restarted
# container resumes by itself.
#
#   IMAGE=spotune RUNS=/mnt/disk/runs scripts/launch/docker-run.sh RECIPE [key=value ...]
#
# Docker cannot tell exit codes apart: `on-failure:N` restarts on every non-zero one, so N
# caps the loop a configuration error or a store permission missing (exit 2, fails in seconds)
# would cause. For the codes
# see docker/entrypoint.sh. `--stop-timeout 120`: `docker stop` waits that long for the save.
# `--network host`: on AWS, IMDSv2 answers a container on the bridge network only when the
# instance's metadata hop limit is 2, and the preemption-notice watcher needs it.
set -euo pipefail
IMAGE=${IMAGE:-spotune}
NAME=${NAME:-spotune}
RUNS=${RUNS:-$PWD/runs}
MAX_RESTARTS=${MAX_RESTARTS:-5}
[ "$#" -ge 1 ] || { echo "usage: $0 RECIPE [key=value ...]" >&2; exit 2; }
mkdir -p "$RUNS"
exec docker run --detach --name "$NAME" \
  --gpus all --ipc host --network host \
  --restart "on-failure:$MAX_RESTARTS" --stop-timeout 120 \
  -v "$RUNS:/work/runs" \
  -e HF_TOKEN -e AWS_ACCESS_KEY_ID -e AWS_SECRET_ACCESS_KEY -e AWS_SESSION_TOKEN -e AWS_ENDPOINT_URL \
  "$IMAGE" "$@"
