"""What the commands that take a recipe share: its arguments, and loading it into a RunConfig."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from trainer import config as C
from trainer.config.source import read_overrides, read_recipe


def add_recipe(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="YAML recipe (omit to use the built-in defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=100 data.seq_len=1024")


def split(recipe: str | None, overrides: Sequence[str]) -> tuple[str | None, list[str]]:
    """`spotune train a.b=1` has no recipe: the first positional is then an override."""
    if recipe is not None and "=" in recipe and not Path(recipe).exists():
        return None, [recipe, *overrides]
    return recipe, list(overrides)


def load(args: argparse.Namespace) -> C.RunConfig:
    """The RunConfig of the recipe and overrides on the command line."""
    return C.load(*split(args.recipe, args.overrides))


def sets(recipe: str | None, overrides: Sequence[str], keys: Sequence[str]) -> bool:
    """Whether the recipe file or the overrides set any of `keys` (dotted), rather than leave it to its
    default. Call after `C.load` of the same arguments, which reports a recipe or override that does not read."""
    named = set(read_overrides(overrides)[0])
    if recipe is not None:
        named |= set(read_recipe(Path(recipe))[1])
    return any(k in named for k in keys)
