"""Scaling out on CPU: what a world-size change costs a resume, and what a second DDP rank costs.

1. Resume after a world-size change: start-up (process start to the first optimizer step, in
   wall seconds: the ledger's `startup_seconds` divided by the world size) of a resume on 1 rank
   from a checkpoint that 2 ranks wrote, beside one that 1 rank wrote (2 -> 1 vs 1 -> 1), and
   on 2 ranks from 1 beside 2 (1 -> 2 vs 2 -> 2). Same global batch (2 rows), same step, same
   launcher within a pair, so only the checkpoint's world size differs. Repeats alternate
   (each side first in turn); medians. Goal: ratio <= 1.1. (The ledger's clock starts at the
   rank's own process start, so torchrun's agent start-up is outside it on both sides.)
2. DDP, 2 ranks against 1: sustained real tokens/s per rank (the last metrics row's
   `sustained_tokens_per_s`, which counts every rank's tokens, divided by the ranks), the same
   micro-batches per rank per step, so ideal scaling is 1.0 and the shortfall is gradient
   all-reduce plus the per-step agreement collective (gloo over loopback).

Both use the tiny Llama of benchmarks/resume.py and `OMP_NUM_THREADS=1` in every rank, so 2
ranks use 2 cores and 1 rank 1 core: the per-rank comparison is per core. On a 2-core machine
anything else running takes from the 2-rank side first.

    .venv/bin/python benchmarks/scaleout.py [--repeats 3] [--steps 30] [--skip-resume] [--skip-ddp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from resume import NEAR, _recipe, _train  # noqa: E402  (benchmarks/resume.py: the seed-run recipe, the launcher)

from trainer import builtin_assets  # noqa: E402
from trainer.restart.books.ledger import read_rows  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _setup(work: Path, examples: int) -> Path:
    """The tiny model, a dataset and a recipe (resume.py's, with a global batch of 2 rows)."""
    tok = builtin_assets.build_tokenizer(work / "tok")
    model = builtin_assets.build_model(work / "model", "llama", tokenizer_dir=tok)
    data = builtin_assets.write_dataset(work / "train.jsonl", n=examples)
    raw = _recipe(work, model, data)
    raw["train"].update(global_batch_size=2, grad_accum=None)
    recipe = work / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    return recipe


def resume_after_world_change(work: Path, recipe: Path, repeats: int) -> dict[str, Any]:
    seeds = {}
    for world in (1, 2):  # a checkpoint at step NEAR written by each world size
        out = work / f"seed-{world}"
        _train(recipe, f"output_dir={out}", world=world, env=ENV)
        seeds[world] = out / "checkpoints" / f"step-{NEAR:06d}"
    pairs = [(2, 1), (1, 1), (1, 2), (2, 2)]  # (world that saved, world that resumes)
    startup: dict[tuple[int, int], list[float]] = {p: [] for p in pairs}
    for r in range(repeats):
        for saved, resumed in pairs if r % 2 == 0 else pairs[::-1]:  # each side goes first in turn
            out = work / f"r{r}-{saved}to{resumed}"
            shutil.copytree(seeds[saved], out / "checkpoints" / seeds[saved].name)
            _train(recipe, f"output_dir={out}", f"train.max_steps={NEAR + 1}", world=resumed, env=ENV)
            row = read_rows(out)[-1]
            startup[(saved, resumed)].append(row["startup_seconds"] / row["world_size"])
            print(f"  repeat {r}: {saved} -> {resumed} rank(s): start-up {startup[(saved, resumed)][-1]:.2f}s")
            shutil.rmtree(out)
    med = {p: statistics.median(v) for p, v in startup.items()}
    print(f"\nresume start-up to the first step, median of {repeats} (wall seconds; goal: ratio <= 1.1)")
    print(f"{'resumes on':>10} | {'same world':>12} | {'other world':>12} | ratio")
    for resumed, other in ((1, 2), (2, 1)):
        same, changed = med[(resumed, resumed)], med[(other, resumed)]
        print(
            f"{resumed:>5} rank{'s' if resumed > 1 else ' '} | {resumed} -> {resumed} {same:6.2f}s | "
            f"{other} -> {resumed} {changed:6.2f}s | {changed / same:.3f}"
        )
    return {
        "median": {f"{a}->{b}": v for (a, b), v in med.items()},
        "all": {f"{a}->{b}": v for (a, b), v in startup.items()},
    }


def ddp_throughput(work: Path, recipe: Path, steps: int, repeats: int) -> dict[str, Any]:
    common = [f"train.max_steps={steps}", "train.micro_batch_size=4", "checkpoint.every_steps=null"]
    common += ["metrics.warmup_steps=3", "checkpoint.every_minutes=null"]
    per_rank: dict[int, list[float]] = {1: [], 2: []}
    for r in range(repeats):
        for world in (1, 2) if r % 2 == 0 else (2, 1):  # 2 micro-batches of 4 rows per rank per step on both sides
            out = work / f"ddp-r{r}-{world}"
            _train(recipe, f"output_dir={out}", f"train.global_batch_size={8 * world}", *common, world=world, env=ENV)
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            per_rank[world].append(rows[-1]["sustained_tokens_per_s"] / world)
            print(f"  repeat {r}: {world} rank(s): {per_rank[world][-1]:,.0f} real tokens/s per rank")
            shutil.rmtree(out)
    one, two = statistics.median(per_rank[1]), statistics.median(per_rank[2])
    print(f"\nDDP on CPU (gloo), OMP_NUM_THREADS=1 per rank, median of {repeats}, {steps} steps (3 of warm-up)")
    print(f"{'ranks':>5} | {'tokens/s per rank':>17} | {'tokens/s in all':>15}")
    print(f"{1:>5} | {one:>17,.0f} | {one:>15,.0f}")
    print(f"{2:>5} | {two:>17,.0f} | {2 * two:>15,.0f}")
    print(
        f"per-rank ratio 2 ranks / 1 rank: {two / one:.3f} (1.0 = no communication cost); speed-up {2 * two / one:.2f}x"
    )
    return {"one": one, "two": two, "ratio": two / one, "all": per_rank}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="steps of each throughput run")
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--skip-resume", action="store_true")
    ap.add_argument("--skip-ddp", action="store_true")
    ap.add_argument("--work", type=Path, help="keep the work files here (default: a temp dir)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="spotune-scaleout-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    recipe = _setup(work, args.examples)
    results: dict[str, Any] = {}
    if not args.skip_resume:
        results["resume"] = resume_after_world_change(work, recipe, args.repeats)
    if not args.skip_ddp:
        results["ddp"] = ddp_throughput(work, recipe, args.steps, args.repeats)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        (work / "results.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"results: {work / 'results.json'}")


if __name__ == "__main__":
    main()
