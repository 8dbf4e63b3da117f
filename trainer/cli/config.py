"""`spotune config`: the resolved config as YAML, or every key with --reference."""

from __future__ import annotations

import argparse

from trainer import config as C
from trainer.cli import recipe

HELP = "print the resolved config, or every key with --reference"


def add_arguments(p: argparse.ArgumentParser) -> None:
    recipe.add_recipe(p)
    p.add_argument("--reference", action="store_true", help="list every key with its default and meaning")


def run(args: argparse.Namespace) -> int:
    cfg = recipe.load(args)
    if args.reference:
        for key, default, doc in C.field_docs():
            print(f"{key:32} {default:24} {doc}")
    else:
        print(C.to_yaml(cfg), end="")
    return 0
