"""`spotune pilot`: measure sustained throughput on the real path, then forecast.

A thin layer over `trainer.cli.pilot_run.run_pilot` (the pilot is a real training run) and
`trainer.cli.world.estimate_for_run`.
"""

from __future__ import annotations

import argparse

from trainer.cli import recipe

HELP = "measure sustained throughput on the real path, then forecast"


def add_arguments(p: argparse.ArgumentParser) -> None:
    recipe.add_recipe(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, help="optimizer steps to measure (default 20)")
    g.add_argument("--minutes", type=float, help="wall minutes to measure")


def run(args: argparse.Namespace) -> int:
    cfg = recipe.load(args)
    recipe.check_model(cfg)
    from trainer.cli.pilot_run import run_pilot
    from trainer.cli.world import estimate_for_run, pilot_dir
    from trainer.plan import pilot
    from trainer.plan.table import format_estimate

    p = run_pilot(cfg, steps=args.steps, minutes=args.minutes)
    if not p:
        return 0  # not rank 0
    print(pilot.format_pilot(p))
    print(f"  written to {pilot_dir(cfg) / 'pilot.json'}\n")
    given = recipe.names_data(*recipe.split(args.recipe, args.overrides))
    # Measured on the built-in demo set when no data was named: the rate, never a price for that data.
    doc = estimate_for_run(cfg, pilot_json=pilot_dir(cfg) / "pilot.json", gpus=p["world_size"], data_given=given)
    print(format_estimate(doc))
    return 0
