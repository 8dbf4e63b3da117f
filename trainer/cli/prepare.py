"""`spotune prepare` and `spotune inspect`: tokenise and pack the dataset once (cached);
inspect also points at the length plot."""

from __future__ import annotations

import argparse

from trainer.cli import recipe

HELP = {
    "prepare": "tokenise and pack the dataset once (cached)",
    "inspect": "dataset length report and seq_len suggestion (prepares if needed)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    recipe.add_recipe(p)


def run(args: argparse.Namespace) -> int:
    cfg = recipe.load(args)
    from trainer.training.inputs import pin_data, prepare_data

    prepared = prepare_data(pin_data(cfg), progress=True)  # a run's hub datasets at its pinned commits
    if args.command == "inspect":
        plot = prepared.train_path.parent / "lengths.png"
        if plot.exists():
            print(f"length plot: {plot}")
    return 0
