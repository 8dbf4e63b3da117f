"""`spotune export`: the final adapter, or a merged full model with --merge."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "write the final adapter, or a merged full model with --merge"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path)
    p.add_argument("--merge", action="store_true", help="merge the adapter into the base weights")
    p.add_argument("--out", type=Path, help="output directory (default <run_dir>/export or merged)")


def run(args: argparse.Namespace) -> int:
    from trainer.serve.export import export

    out = export(args.run_dir, args.out, merge=args.merge)
    print(f"spotune: wrote {out}")
    return 0
