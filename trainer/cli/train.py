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
    # The run's lock and lease before torch and transformers are imported (~6 s of CPU): a start refused
    # because another attempt holds the run, or because the store refuses writes, says so in a second.
    from trainer.restart.ownership import owner

    held = owner.take_run(cfg, args.wait)
    try:
        from trainer.training.run import train

        return train(cfg, wait=args.wait, held=held)
    finally:
        held.release()  # train's first attempt released it already, unless the import failed
