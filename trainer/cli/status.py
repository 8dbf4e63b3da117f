"""`spotune status`: who holds a run now (its directory's lock, the remote's lease); `--break-lease` by hand."""

from __future__ import annotations

import argparse

HELP = "who holds a run now (its directory's lock, the remote's lease)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="the run's output_dir, or its checkpoint.remote URL")
    p.add_argument("--break-lease", action="store_true", help="release the remote lease by hand (its holder is gone)")


def run(args: argparse.Namespace) -> int:
    from trainer.restart.owner import status_command

    return status_command(args.run, args.break_lease)
