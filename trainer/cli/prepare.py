"""`spotune prepare` and `spotune inspect`: tokenise and pack the dataset once (cached);
inspect also points at the length plot and, with --show N, prints N examples with trained tokens marked."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trainer.cli import recipe

HELP = {
    "prepare": "tokenise and pack the dataset once (cached)",
    "inspect": "dataset length report and seq_len suggestion (prepares if needed); --show N prints examples",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    recipe.add_recipe(p)
    if p.prog.endswith("inspect"):
        p.add_argument(
            "--show",
            type=int,
            default=0,
            metavar="N",
            help="print the first N examples as the model sees them, trained tokens marked ([[...]] when not a terminal)",
        )


def run(args: argparse.Namespace) -> int:
    cfg = recipe.load(args)
    recipe.check_model(cfg)
    from trainer.training.inputs import pin_data, prepare_data

    cfg = pin_data(cfg)
    if args.command == "inspect" and args.show > 0:
        from trainer.data.show import show_examples
        from trainer.training.inputs import prepares_pairs, resolved_data, tokenizer_path

        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        # Every source as prepare reads it: a folder, a hub dataset at its pinned commit, each of a mix.
        shown = show_examples(resolved_data(cfg), tokenizer_path(cfg), args.show, color, cfg.seed, prepares_pairs(cfg))
        print(shown, flush=True)
    prepared = prepare_data(cfg)  # a run's hub datasets at its pinned commits
    if args.command == "inspect":
        from trainer.data.report import lengths_plot

        plot = lengths_plot(prepared.train_path.parent, prepared.manifest)
        print(f"length plot: {plot}" if isinstance(plot, Path) else f"length plot: none ({plot})")
    return 0
