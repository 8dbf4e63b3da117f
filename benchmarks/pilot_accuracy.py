"""Does a pilot forecast the full run's wall time? Tiny recipe on CPU, target within 10%.

    .venv/bin/python benchmarks/pilot_accuracy.py [--steps 15] [--workdir DIR]

1. `spotune pilot recipes/tiny-cpu.yaml --steps N` in a fresh process (it prepares the data
   once, into the run's cache, and takes that time out of its startup);
2. the forecast: `run_estimate` with the pilot.json, on the row of the device the pilot ran
   on (wall hours = startup + warm-up + tokens / sustained rate + saves + teardown);
3. `spotune train` of the full recipe in a fresh process on the same cache;
4. prints forecast / measured, with the measurement being the full run's ledger wall time
   (process start to exit, the same clock the pilot's startup is read from).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer import config  # noqa: E402
from trainer.plan.estimate import run_estimate  # noqa: E402


def spotune(*args: str) -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "trainer", *args], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=15, help="pilot steps")
    ap.add_argument("--workdir", type=Path, help="where runs go (default: a temp dir)")
    ap.add_argument("--recipe", default=str(REPO / "recipes" / "tiny-cpu.yaml"))
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="spotune-pilot-accuracy-"))
    os.environ.setdefault("SPOTUNE_HOME", str(work / "home"))
    overrides = [f"output_dir={work / 'run'}", "metrics.progress=false"]
    cfg = config.load(args.recipe, overrides)

    pilot_wall = spotune("pilot", args.recipe, *overrides, "--steps", str(args.steps))
    pilot = json.loads((work / "run" / "pilot" / "pilot.json").read_text())
    result = run_estimate(cfg, pilot_json=work / "run" / "pilot" / "pilot.json", gpus=pilot["world_size"])
    row = next(o for o in result["options"] if o["gpu"] == pilot["device"])
    forecast_s = row["wall_hours"]["expected"] * 3600
    low_s, high_s = row["wall_hours"]["low"] * 3600, row["wall_hours"]["high"] * 3600

    full_wall = spotune("train", args.recipe, *overrides)
    ledger = [json.loads(x) for x in (work / "run" / "ledger.jsonl").read_text().splitlines() if x.strip()]
    measured_s = float(ledger[-1]["wall_seconds"])

    print(f"recipe {args.recipe}: {result['run']['steps']} steps; pilot {args.steps} steps on {pilot['device']}")
    print(f"pilot: {pilot['sustained_tokens_per_s']:,.0f} real tokens/s, startup {pilot['startup_seconds']:.1f} s "
          f"(+{pilot['prepare_seconds']:.1f} s data preparation, once), save {pilot['save_seconds']:.2f} s, "
          f"pilot process {pilot_wall:.1f} s")
    print(f"forecast wall {forecast_s:.1f} s (range {low_s:.1f}-{high_s:.1f}); measured full run {measured_s:.1f} s "
          f"(ledger; process {full_wall:.1f} s as seen from outside)")
    ratio = forecast_s / measured_s
    print(f"ratio forecast/measured = {ratio:.3f} ({'within' if abs(ratio - 1) <= 0.10 else 'OUTSIDE'} 10%)")


if __name__ == "__main__":
    main()
