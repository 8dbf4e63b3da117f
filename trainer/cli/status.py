"""`spotune status`: where a run stands (finished, training, stopped), its newest checkpoint, hours
and cost, attempts, and who holds it; `--break-lease` by hand."""

from __future__ import annotations

import argparse
import json

HELP = "where a run stands: finished / training / stopped, its checkpoint, hours, cost, attempts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="the run's output_dir, or its checkpoint.remote URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--break-lease", action="store_true", help="release the remote lease by hand (its holder is gone)")


def run(args: argparse.Namespace) -> int:
    from trainer.report.status import as_dict, format_status, run_status

    if args.break_lease:
        from trainer.restart.owner import status_command

        code = status_command(args.run, True)
        if code:
            return code
    status = run_status(args.run)  # NotARun (exit 2) for a directory or URL that holds no run
    print(json.dumps(as_dict(status), indent=2) if args.json else format_status(status))
    return 0
