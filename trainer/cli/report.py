"""`spotune report`: report.html and PNGs of a run (local directory or fsspec URL)."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "report.html and PNGs of a run (local directory or fsspec URL)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run's output_dir, or its checkpoint.remote URL (s3://, gs://, file://)")
    p.add_argument("--out", type=Path, help="where to write (default: the run directory when local)")


def run(args: argparse.Namespace) -> int:
    from trainer.report import write_report

    page, summary = write_report(args.run_dir, args.out)
    print(f"spotune: {summary}\nspotune: run report: {page}")
    return 0
