"""`spotune train`: train; the same command resumes from the newest good checkpoint."""

from __future__ import annotations

import argparse

from trainer.cli import recipe

HELP = "train; the same command resumes from the newest good checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    recipe.add_recipe(p)
    p.add_argument(
        "--wait", type=float, metavar="SECONDS", help="if another attempt holds the run, wait this long for it"
    )


def run(args: argparse.Namespace) -> int:
    cfg = recipe.load(args)
    recipe.check_model(cfg)
    from trainer.training.run import train

    return train(cfg, wait=args.wait)
