"""`spotune status`: where a run stands (finished, training, stopped), its newest checkpoint, hours
and cost, attempts, and who holds it (trainer/report/status.py); `--break-lease` by hand
(trainer/restart/ownership/owner.py), its one-line result first (in the JSON document under --json)."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "where a run stands: finished / training / stopped, its checkpoint, hours, cost, attempts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="the run's output_dir, or its checkpoint.remote URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--break-lease", action="store_true", help="release the remote lease by hand (its holder is gone)")


def run(args: argparse.Namespace) -> int:
    from trainer.report.status import as_dict, format_status, run_remote, run_status

    broke = None
    if args.break_lease:
        from trainer.restart.ownership.owner import break_lease

        remote, options = run_remote(args.run)
        if remote is None:
            print(
                f"spotune: {args.run} has no checkpoint.remote: nothing to break (a local lock dies with its process)",
                file=sys.stderr,
            )
            return 2
        broke = break_lease(remote, options)  # one line, before the status that shows its effect
    status = run_status(args.run)  # NotARun (exit 2) for a directory or URL that holds no run
    if args.json:
        print(json.dumps({**as_dict(status), **({"break_lease": broke} if broke else {})}, indent=2))
    else:
        if broke:
            print(f"spotune: {broke}")
        print(format_status(status))
    return 0
