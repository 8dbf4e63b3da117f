"""Does the forecast hold? One pilot, then N full runs timed from outside, each against the
forecast for its own directory. Goal: median |error| <= 5%, >= 90% of actuals inside the range.

    .venv/bin/python benchmarks/forecast.py [--repeats 10] [--steps 60] [--pilot-steps 20] [--workdir DIR]

The case: real instruction data the project never saw (gpteacher-roleplay.json in the data
folder beside the repository, `DATA` below; `--data` another), the tiny CPU recipe, 60 optimizer steps, micro-batch 2,
accumulation 2, seq 512. Two kinds of full run, interleaved so machine drift hits both:

- `fresh`: a new output_dir, as on a new VM: it prepares the data itself; the forecast is
  `spotune estimate --pilot <pilot.json>` asked for that directory (no cache there);
- `shared`: a new output_dir whose data.cache_dir is the pilot's: a cache hit.

Each run is a `spotune train` process timed from outside, start to exit: what a user pays.
The error is forecast/actual - 1 on the expected value; `inside` means low <= actual <= high.
Every process gets one torch thread (both sides alike; a shared machine disturbs one thread less).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer import config  # noqa: E402
from trainer.cli.world import estimate_for_run  # noqa: E402
from trainer.plan.pilot import summarise  # noqa: E402
from trainer.restart.books.ledger import read_rows  # noqa: E402

DATA = REPO.parent / "shared" / "data" / "gpteacher-roleplay.json"


def spotune(*args: str) -> tuple[float, float]:
    """Run the CLI in a fresh process: its wall seconds, start to exit, and its CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "trainer", *args], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def forecast(recipe: str, overrides: list[str], pilot_json: Path) -> tuple[float, float, float, dict[str, float]]:
    """(low, expected, high) wall seconds on the pilot's device, for the directory in `overrides`,
    and the forecast's items (the steps and each fixed cost)."""
    cfg = config.load(recipe, overrides)
    pilot = json.loads(pilot_json.read_text())
    doc = estimate_for_run(cfg, pilot_json=pilot_json, gpus=pilot["world_size"])
    row = next(o for o in doc["options"] if o["gpu"] == pilot["device"])
    w = row["wall_hours"]
    items = {i["name"]: i["seconds"] for i in doc["timeline"]["attempt"]}
    items["steps"] = row["compute_hours"]["expected"] * 3600
    return w["low"] * 3600, w["expected"] * 3600, w["high"] * 3600, items


# The forecast's item names (trainer/plan/timeline.py) against the measured parts of a run.
MEASURED_AS = {
    "interpreter start and imports": "imports",
    "model load and adapter": "model",
    "data": "data",
    "other set-up (optimizer, sampler, loader)": "setup",
    "write final/ (adapter + tokenizer)": "final",
    "report page": "report",
    "interpreter exit": "exit",
}


def measured_parts(out: Path, outside: float) -> dict[str, float]:
    """One finished run cut into the forecast's items by the pilot's rule (plan/pilot.py); its
    steps (warm-up included: the run logs too seldom to tell them apart) from the ledger."""
    run = summarise(out, 0, "measured", {1: outside})
    (a,) = run["attempts"]
    parts = {k: run["fixed"][k] or 0.0 for k in ("imports", "model", "setup", "exit", "final", "report")}
    parts["data"] = a["phases"].get("data", 0.0)
    (row,) = read_rows(out)
    parts["steps"] = row["productive_seconds"] / row["world_size"]
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10, help="full runs of each kind")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps of the full run")
    ap.add_argument("--pilot-steps", type=int, default=20)
    ap.add_argument("--workdir", type=Path, help="where runs go (default: a temp dir)")
    ap.add_argument("--recipe", default=str(REPO / "recipes" / "tiny-cpu.yaml"))
    ap.add_argument("--data", type=Path, default=DATA, help="instruction data in the alpaca layout")
    ap.add_argument("--json", type=Path, help="also write every trial here")
    args = ap.parse_args()
    if not args.data.is_file():
        raise SystemExit(f"{args.data} is missing: give --data, a JSON file of instruction rows in the alpaca layout")
    os.environ["OMP_NUM_THREADS"] = "1"
    work = args.workdir or Path(tempfile.mkdtemp(prefix="spotune-forecast-"))
    os.environ.setdefault("SPOTUNE_HOME", str(work / "home"))  # the tiny model is built once, then on disk
    case = [
        f"train.max_steps={args.steps}",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "data.seq_len=512",
        f"data.path={args.data}",
        "metrics.progress=false",
    ]
    pilot_dir = work / "pilot-run"
    pilot_wall, _ = spotune("pilot", args.recipe, *case, f"output_dir={pilot_dir}", "--steps", str(args.pilot_steps))
    pilot_json = pilot_dir / "pilot" / "pilot.json"
    p = json.loads(pilot_json.read_text())
    print(
        f"pilot: {p['steps']} steps in {len(p['attempts'])} processes, {pilot_wall:.1f} s; "
        f"{p['sustained_tokens_per_s']:,.0f} tokens/s, step sd {p['step_time_s']['sd']:.3f} s "
        f"(between processes {p['step_time_s']['between_sd'] or 0:.3f} s), fixed sd {p['fixed']['sd'] or 0:.2f} s"
    )
    trials: list[dict[str, Any]] = []
    print(f"{'run':<10}{'forecast':>9}{'low':>8}{'high':>8}{'actual':>8}{'error':>8}  inside  {'cpu s':>6}")
    for i in range(args.repeats):
        for kind in ("fresh", "shared"):
            out = [f"output_dir={work / f'{kind}-{i}'}"]
            if kind == "shared":
                out.append(f"data.cache_dir={pilot_dir / 'data'}")
            low, expected, high, items = forecast(args.recipe, case + out, pilot_json)
            actual, cpu = spotune("train", args.recipe, *case, *out)
            trial: dict[str, Any] = {
                "kind": kind,
                "low": low,
                "expected": expected,
                "high": high,
                "actual": actual,
                "cpu": cpu,
            }
            trial["forecast_items"] = items
            trial["measured"] = measured_parts(Path(out[0].split("=", 1)[1]), actual)
            trial["error"] = expected / actual - 1
            trial["inside"] = low <= actual <= high
            trials.append(trial)
            print(
                f"{kind}-{i:<4}{expected:>9.1f}{low:>8.1f}{high:>8.1f}{actual:>8.1f}{trial['error']:>+8.1%}  "
                f"{'yes' if trial['inside'] else 'NO ':<3}  {cpu:>7.1f}",
                flush=True,
            )
    print()
    for kind in ("fresh", "shared", "all"):
        mine = [t for t in trials if kind in ("all", t["kind"])]
        med = statistics.median(abs(t["error"]) for t in mine)
        signed = statistics.median(t["error"] for t in mine)
        inside = sum(t["inside"] for t in mine)
        walls = [t["actual"] for t in mine]
        print(
            f"{kind:<7} identical runs took {min(walls):.1f}-{max(walls):.1f} s "
            f"(sd {statistics.stdev(walls) / statistics.fmean(walls):.1%} of the mean): the machine's own variation"
        )
        print(
            f"{kind:<7} median |error| {med:.1%} (goal <= 5%), median error {signed:+.1%}, "
            f"inside the range {inside}/{len(mine)} = {inside / len(mine):.0%} (goal >= 90%); "
            f"a forecast that knew the other runs' median: {statistics.median(_hindsight(mine)):.1%}"
        )
    print("\nwhere the error is: each item's forecast against the runs' median (seconds)")
    print(f"{'item':<12}{'forecast':>10}{'runs':>8}{'runs min-max':>16}{'forecast - runs':>17}")
    for kind in ("fresh", "shared"):
        mine = [t for t in trials if t["kind"] == kind]
        for name, part in [*MEASURED_AS.items(), ("steps", "steps")]:
            said = [_item(t, name) for t in mine]
            got = [t["measured"][part] for t in mine]
            f, m = statistics.median(said), statistics.median(got)
            print(f"{kind[:5]} {part:<6}{f:>10.2f}{m:>8.2f}{min(got):>8.2f}-{max(got):<7.2f}{f - m:>+17.2f}")
    if args.json:
        args.json.write_text(json.dumps({"pilot": p, "trials": trials}, indent=2))


def _hindsight(trials: list[dict[str, Any]]) -> list[float]:
    """|error| of each run against the median of the other runs of its kind: the floor the
    machine's own variation sets for any forecast made before a run."""
    out = []
    for t in trials:
        others = [o["actual"] for o in trials if o is not t and o["kind"] == t["kind"]]
        if others:
            out.append(abs(statistics.median(others) / t["actual"] - 1))
    return out or [0.0]


def _item(trial: dict[str, Any], name: str) -> float:
    """The forecast's seconds for one measured part: data is a hit or a preparation, whichever
    the directory saw; the steps include the pilot's warm-up extra (the runs' are not apart)."""
    items = trial["forecast_items"]
    if name == "data":
        return sum(v for k, v in items.items() if k.startswith("data"))
    if name == "steps":
        return items["steps"] + items.get("warm-up steps beyond the sustained rate", 0.0)
    return float(items.get(name, 0.0))


if __name__ == "__main__":
    main()
