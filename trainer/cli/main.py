"""`spotune` command line: parse, load the config, hand over to the module that does the work.

Exit codes are defined and documented once, in trainer/exit_codes.py: 0 finished,
143 preempted after saving (requeue), 3 budget reached, 4 too many non-finite steps,
130 aborted, 2 bad configuration or input, 1 anything else.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from trainer import config as C
from trainer.exit_codes import EXIT_BAD_INPUT, EXIT_FILE_ENV


def _add_recipe(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="YAML recipe (omit to use the built-in defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=100 data.seq_len=1024")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spotune", description="Restart-safe LoRA/QLoRA fine-tuning.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="tokenise and pack the dataset once (cached)")
    _add_recipe(p)
    p = sub.add_parser("inspect", help="dataset length report and seq_len suggestion (prepares if needed)")
    _add_recipe(p)
    p = sub.add_parser("train", help="train; the same command resumes from the newest good checkpoint")
    _add_recipe(p)

    p = sub.add_parser("estimate", help="memory fit, GPU-hours and cost, on-demand against spot")
    p.add_argument("recipe", nargs="?", help="YAML recipe, or a hub model id such as meta-llama/Llama-3.1-8B")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=100 data.seq_len=1024")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--throughput", type=float, help="sustained tokens/s per GPU, if known")
    p.add_argument(
        "--pilot", type=Path, help="pilot.json from `spotune pilot` (default: <output_dir>/pilot/pilot.json if present)"
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

    p = sub.add_parser("pilot", help="measure sustained throughput on the real path, then forecast")
    _add_recipe(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, help="optimizer steps to measure (default 20)")
    g.add_argument("--minutes", type=float, help="wall minutes to measure")

    p = sub.add_parser("export", help="write the final adapter, or a merged full model with --merge")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--merge", action="store_true", help="merge the adapter into the base weights")
    p.add_argument("--out", type=Path, help="output directory (default <run_dir>/export or merged)")

    p = sub.add_parser("report", help="report.html and PNGs of a run (local directory or fsspec URL)")
    p.add_argument("run_dir", help="the run's output_dir, or its checkpoint.remote URL (s3://, gs://, file://)")
    p.add_argument("--out", type=Path, help="where to write (default: the run directory when local)")

    p = sub.add_parser("config", help="print the resolved config, or every key with --reference")
    _add_recipe(p)
    p.add_argument("--reference", action="store_true", help="list every key with its default and meaning")
    return ap


def _split(recipe: str | None, overrides: Sequence[str]) -> tuple[str | None, list[str]]:
    """`spotune train a.b=1` has no recipe: the first positional is then an override."""
    if recipe is not None and "=" in recipe and not Path(recipe).exists():
        return None, [recipe, *overrides]
    return recipe, list(overrides)


def main(argv: Sequence[str] | None = None) -> int:
    code = _main(argv)
    _record_exit_code(code)
    return code


def _record_exit_code(code: int) -> None:
    """Under a launcher that sets SPOTUNE_EXIT_FILE, the main rank writes its code there too."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        from trainer.atomic import write_text

        write_text(Path(path), f"{code}\n")


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    from trainer.catalog import CatalogError
    from trainer.data import DataError
    from trainer.plan import PlanError
    from trainer.report import ReportError
    from trainer.restart.checkpoint import CheckpointError

    try:
        return _dispatch(args)
    except (C.ConfigError, DataError, CheckpointError, PlanError, CatalogError, ReportError) as e:
        # Each carries complete sentences naming the key, file or line to fix; a traceback
        # would only bury them. CheckpointError covers "none verifies" and ResumeMismatch.
        print(f"spotune: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "export":
        from trainer.export import export

        out = export(args.run_dir, args.out, merge=args.merge)
        print(f"spotune: wrote {out}")
        return 0
    if args.command == "report":
        from trainer.report import write_report

        page, summary = write_report(args.run_dir, args.out)
        print(f"spotune: {summary}\nspotune: run report: {page}")
        return 0

    recipe, overrides = _split(args.recipe, args.overrides)
    if args.command == "estimate" and recipe is not None:
        from trainer.plan.models import looks_like_model_id

        if looks_like_model_id(recipe):  # `spotune estimate meta-llama/Llama-3.1-8B`: built-in defaults otherwise
            recipe, overrides = None, [f"model.name_or_path={recipe}", *overrides]
    cfg = C.load(recipe, overrides)

    if args.command == "config":
        if args.reference:
            for key, default, doc in C.field_docs():
                print(f"{key:32} {default:24} {doc}")
        else:
            print(C.to_yaml(cfg), end="")
        return 0

    from trainer.training import run

    if args.command in ("prepare", "inspect"):
        prepared = run.prepare_data(cfg, progress=True)
        if args.command == "inspect":
            plot = prepared.train_path.parent / "lengths.png"
            if plot.exists():
                print(f"length plot: {plot}")
        return 0
    if args.command == "train":
        return run.train(cfg)
    if args.command == "estimate":
        from trainer.plan.world import estimate_command

        return estimate_command(cfg, args)
    if args.command == "pilot":
        from trainer.plan.pilot_run import pilot_command

        return pilot_command(cfg, steps=args.steps, minutes=args.minutes)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
