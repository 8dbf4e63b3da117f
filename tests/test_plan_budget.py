"""Budget guards: `train.max_cost` stops a run with a checkpoint; raising it and rerunning continues.

(`train.max_gpu_hours` stopping at step 1 is covered in tests/test_train.py.) Device-hours
count from process start, so inside a test process any small limit is already spent at the
first step: the stop is deterministic at step 1.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer import config, exit_codes
from trainer.restart.books.ledger import read_rows
from trainer.training import run


def test_max_cost_stops_with_a_checkpoint_and_a_rerun_continues(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path
) -> None:
    out = tmp_path / "run"
    base = {
        "output_dir": str(out),
        "model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
        "data": {"path": str(tiny_data), "seq_len": 128},
        "train": {"max_steps": 4, "micro_batch_size": 2},
        "checkpoint": {"every_minutes": None},
        "metrics": {"progress": False, "price_per_hour": 2.0},
    }
    capped = config.from_dict({**base, "train": {**base["train"], "max_cost": 1e-9}})
    assert run.train(capped) == exit_codes.EXIT_BUDGET
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]
    rows = read_rows(out)
    assert [r["exit_reason"] for r in rows] == ["budget"]
    assert rows[0]["cost"] == rows[0]["device_seconds"] / 3600 * 2.0 > 1e-9

    # Raise the limit (here: remove it) and run the same command again: it resumes and finishes.
    assert run.train(config.from_dict(base)) == exit_codes.EXIT_FINISHED
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if "loss" in x]
    assert steps == [1, 2, 3, 4]  # control: step 1 is not redone, and the run did go on past the cap
    assert [r["exit_reason"] for r in read_rows(out)] == ["budget", "finished"]
