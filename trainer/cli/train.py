"""`spotune train`: train; the same command resumes from the newest good checkpoint."""

from __future__ import annotations

import argparse

from trainer.cli import recipe

HELP = "train; the same command resumes from the newest good checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    recipe.add_recipe(p)


def run(args: argparse.Namespace) -> int:
    cfg = recipe.load(args)
    from trainer.training.run import train

    return train(cfg)
