#!/usr/bin/env bash
# Run a command on the CPU time nothing else wants (make test runs mypy beside the tests with it).
#
# `nice -n 19` alone is not that where the kernel schedules by session (autogroups, on by default in
# most desktop and server kernels: /proc/sys/kernel/sched_autogroup_enabled): CPU time is shared
# between sessions first and by nice only within one. Every drill's attempt is a session of its own,
# so a niced mypy in make's session got a whole session's share beside them: two busy attempts and it
# got 6.3 of 20 CPU-s; in a session of its own whose group is niced to 19 it got 0.2 (two loops in
# sessions of their own against a third, 10 s). So: a session of its own, its autogroup niced, then nice.
# Where there are no autogroups (or no setsid) it is plain `nice -n 19`.
set -eu
if [ "${1:-}" = --own-session ]; then
  shift
  echo 19 2>/dev/null >/proc/self/autogroup || true  # raising a nice needs no privilege
elif command -v setsid >/dev/null 2>&1 && [ -e /proc/self/autogroup ]; then
  exec setsid --wait "$0" --own-session "$@"
fi
exec nice -n 19 "$@"
