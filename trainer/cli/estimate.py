"""`spotune estimate`: memory fit, GPU-hours and cost, on-demand against spot.

A thin layer over `trainer.cli.world.estimate_for_run`, which reads the world for trainer/plan/.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trainer import config as C
from trainer.cli import recipe

HELP = "memory fit, GPU-hours and cost, on-demand against spot"
MODEL_ONLY = (
    "model.gradient_checkpointing=auto",
    "model.activation_offload=auto",
    "train.global_batch_size=16",
    "train.micro_batch_size=auto",
)
"""The memory settings `spotune estimate MODEL` (no recipe) prices: those of the shipped GPU recipes
(recipes/gpu/), so each GPU is priced as a run would train on it (`auto` picks the fastest setting that
fits there), not with the built-in defaults (checkpointing off), which are the tiny CPU demo's.
Overrides on the command line win."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="YAML recipe, or a hub model id such as meta-llama/Llama-3.1-8B")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=100 data.seq_len=1024")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--throughput", type=float, help="sustained tokens/s per GPU, if known")
    p.add_argument(
        "--pilot", type=Path, help="pilot.json from `spotune pilot` (default: <output_dir>/pilot/pilot.json if present)"
    )
    p.add_argument(
        "--tokens",
        type=float,
        help="real tokens per epoch of the data, for time and cost without the data file (default: count the "
        "recipe's data.path; without it, the memory fit alone)",
    )
    p.add_argument(
        "--longest",
        action="store_true",
        help="the longest one-document row (data.seq_len, micro-batch 1) each GPU trains with the recipe's "
        "settings, its GPU and host memory and tokens/s, instead of the run's forecast",
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs per run")
    p.add_argument("--gpu", help="forecast for this catalogue GPU only")
    p.add_argument("--deadline-hours", type=float, help="recommend the cheapest option finishing within this")
    p.add_argument("--budget", type=float, help="recommend the fastest option costing at most this")
    p.add_argument("--catalog", type=Path, help="YAML that overrides or extends the GPU catalogue (prices especially)")
    p.add_argument("--mfu", type=float, help="assumed MFU when no throughput is measured")
    p.add_argument(
        "--download-mb-s",
        type=float,
        help="download speed of the machine the run will use, MB/s: base model and checkpoint "
        "downloads on a fresh or replacement VM (default: an assumed 200)",
    )
    p.add_argument(
        "--vm-start-seconds",
        type=float,
        help="seconds to get a replacement spot VM running (default: an assumed 180; "
        "the run's ledger replaces it once it has interruptions)",
    )
    p.add_argument(
        "--mtbi-hours",
        action="append",
        metavar="[GPU=]H",
        help="mean time between spot interruptions, hours, behind every spot figure: H for every GPU, "
        "GPU=H for one (repeat it); default: the catalogue's mtbi_hours (typical, provider dependent)",
    )


def run(args: argparse.Namespace) -> int:
    path, overrides = recipe.split(args.recipe, args.overrides)
    if path is not None:
        from trainer.plan.models import looks_like_model_id

        # `spotune estimate meta-llama/Llama-3.1-8B` (or a model's folder): built-in defaults otherwise
        if looks_like_model_id(path) or Path(path).is_dir():
            path, overrides = None, [f"model.name_or_path={path}", *MODEL_ONLY, *overrides]
        elif not Path(path).exists() and not path.endswith((".yaml", ".yml")):
            raise C.ConfigError(
                [f"{path} is neither a recipe file, a model's folder nor a hub model id (org/name); check the path"],
                "estimate",
            )
    cfg = C.load(path, overrides)
    recipe.check_model(cfg, download=False)  # shipped shapes plan offline: no cache needed
    return estimate_command(cfg, args, data_given=recipe.names_data(path, overrides))


def estimate_command(cfg: C.RunConfig, args: Any, data_given: bool = True) -> int:
    """Print the table (or JSON); exit 0. `data_given`: the recipe or the command line named the data
    (else, without --tokens, the memory fit alone)."""
    from trainer.cli.world import estimate_for_run, longest_for_run, pilot_dir
    from trainer.plan.longest import format_longest
    from trainer.plan.table import format_estimate

    if getattr(args, "longest", False):
        found = longest_for_run(cfg, gpus=args.gpus, gpu=args.gpu, catalog_path=args.catalog, mfu=args.mfu)
        print(json.dumps(found, indent=2) if args.json else format_longest(found))
        return 0

    pilot_json = args.pilot
    if pilot_json is None:
        default = pilot_dir(cfg) / "pilot.json"
        pilot_json = default if default.is_file() else None
    result = estimate_for_run(
        cfg,
        throughput=args.throughput,
        pilot_json=pilot_json,
        gpus=args.gpus,
        deadline_hours=args.deadline_hours,
        budget=args.budget,
        catalog_path=args.catalog,
        gpu=args.gpu,
        mfu=args.mfu,
        download_mb_s=getattr(args, "download_mb_s", None),
        vm_start_seconds=getattr(args, "vm_start_seconds", None),
        tokens=getattr(args, "tokens", None),
        data_given=data_given,
        mtbi_hours=getattr(args, "mtbi_hours", None),
    )
    print(json.dumps(result, indent=2) if args.json else format_estimate(result))
    return 0
