"""Does a pilot forecast the full run's wall time? Tiny recipe on CPU, target within 10%.

    .venv/bin/python benchmarks/pilot_accuracy.py [--steps 15] [--repeats 3 (default)] [--workdir DIR]

1. `spotune pilot recipes/tiny-cpu.yaml --steps N` in a fresh process (it prepares the data
   once, into the run's cache, and takes that time out of its startup);
2. the forecast: `estimate_for_run` with the pilot.json, on the row of the device the pilot ran
   on (wall hours = startup + warm-up + tokens / sustained rate + saves + teardown);
3. `spotune train` of the full recipe in a fresh process on the same cache;
4. prints forecast / measured, with the measurement being the full run's ledger wall time
   (process start to exit, the same clock the pilot's startup is read from), and the same
   ratio adjusted for CPU contention (each process's wall / CPU time), for shared machines;
   with --repeats, the median over several pilot + full-run pairs.

Both processes run with one torch thread by default: on a machine shared with other jobs a
single thread is disturbed less (and the same setting applies to both sides).
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer import config  # noqa: E402
from trainer.plan_cli import estimate_for_run  # noqa: E402


def spotune(*args: str) -> tuple[float, float]:
    """Run the CLI in a fresh process: (wall seconds, CPU seconds of that process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "trainer", *args], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def once(recipe: str, steps: int, work: Path) -> tuple[float, float]:
    """One pilot + full run in `work`; prints the details, returns (ratio, contention-adjusted ratio)."""
    overrides = [f"output_dir={work / 'run'}", "metrics.progress=false"]
    cfg = config.load(recipe, overrides)

    pilot_wall, pilot_cpu = spotune("pilot", recipe, *overrides, "--steps", str(steps))
    pilot = json.loads((work / "run" / "pilot" / "pilot.json").read_text())
    result = estimate_for_run(cfg, pilot_json=work / "run" / "pilot" / "pilot.json", gpus=pilot["world_size"])
    row = next(o for o in result["options"] if o["gpu"] == pilot["device"])
    forecast_s = row["wall_hours"]["expected"] * 3600
    low_s, high_s = row["wall_hours"]["low"] * 3600, row["wall_hours"]["high"] * 3600

    full_wall, full_cpu = spotune("train", recipe, *overrides)
    ledger = [json.loads(x) for x in (work / "run" / "ledger.jsonl").read_text().splitlines() if x.strip()]
    measured_s = float(ledger[-1]["wall_seconds"])

    print(f"recipe {recipe}: {result['run']['steps']} steps; pilot {steps} steps on {pilot['device']}")
    print(
        f"  pilot: {pilot['sustained_tokens_per_s']:,.0f} real tokens/s, startup {pilot['startup_seconds']:.1f} s "
        f"(+{pilot['prepare_seconds']:.1f} s data preparation, once), save {pilot['save_seconds']:.2f} s, "
        f"pilot process {pilot_wall:.1f} s"
    )
    print(
        f"  forecast wall {forecast_s:.1f} s (range {low_s:.1f}-{high_s:.1f}); measured full run {measured_s:.1f} s "
        f"(ledger; process {full_wall:.1f} s as seen from outside)"
    )
    ratio = forecast_s / measured_s
    # On a shared machine other processes slow either run by a varying factor: wall / CPU time
    # of a single-threaded process. Dividing each side by its own factor compares the two in
    # uncontended time; with the machine to itself both factors are ~1 and the ratios agree.
    slow_pilot, slow_full = pilot_wall / pilot_cpu, full_wall / full_cpu
    adjusted = ratio * slow_full / slow_pilot
    print(
        f"  ratio forecast/measured = {ratio:.3f}; contention (wall/CPU) pilot {slow_pilot:.2f}, "
        f"full run {slow_full:.2f}; contention-adjusted ratio = {adjusted:.3f}"
    )
    return ratio, adjusted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15, help="pilot steps")
    ap.add_argument("--repeats", type=int, default=3, help="pilot + full run pairs; the median ratio is reported")
    ap.add_argument("--workdir", type=Path, help="where runs go (default: a temp dir)")
    ap.add_argument("--recipe", default=str(REPO / "recipes" / "tiny-cpu.yaml"))
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads for both runs (1 keeps a shared machine's noise down; 0 = torch default)",
    )
    args = ap.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="spotune-pilot-accuracy-"))
    os.environ.setdefault("SPOTUNE_HOME", str(work / "home"))
    results = [once(args.recipe, args.steps, work / f"repeat-{i}") for i in range(args.repeats)]
    ratio = statistics.median(r for r, _ in results)
    adjusted = statistics.median(a for _, a in results)
    verdict = "within" if abs(ratio - 1) <= 0.10 else "OUTSIDE"
    print(
        f"median ratio forecast/measured over {len(results)} pair(s) = {ratio:.3f} ({verdict} 10%); "
        f"contention-adjusted {adjusted:.3f}"
    )


if __name__ == "__main__":
    main()
