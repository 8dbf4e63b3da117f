"""`spotune pilot`: its config, its summary maths on a known log, and one real tiny pilot."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pytest

from trainer import config, plan_cli, run
from trainer.plan import PlanError, pilot


@pytest.fixture()
def cfg(tmp_path: Path, tiny_llama: Path, tiny_data: Path) -> config.RunConfig:
    return config.from_dict(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
            "data": {"path": str(tiny_data), "seq_len": 128},
            "train": {"max_steps": 40, "micro_batch_size": 2, "grad_accum": 1, "eval_every": 10},
            "checkpoint": {"every_steps": 10},
            "metrics": {"progress": False, "warmup_steps": 2, "log_every": 5},
        }
    )


def test_pilot_config_changes_only_what_it_must(cfg: config.RunConfig) -> None:
    p = plan_cli.pilot_config(cfg, steps=7)
    assert p.output_dir == str(Path(cfg.output_dir) / "pilot")
    assert p.data.cache_dir == str(Path(cfg.output_dir) / "data")  # the run's own cache: prepared once
    assert (p.train.max_steps, p.checkpoint.resume, p.checkpoint.every_steps, p.metrics.log_every) == (
        7,
        "never",
        None,
        1,
    )
    assert p.train.eval_every is None and p.train.max_gpu_hours is None
    assert (p.model, p.adapter, p.data.seq_len, p.train.micro_batch_size, p.train.lr) == (
        cfg.model,
        cfg.adapter,
        cfg.data.seq_len,
        cfg.train.micro_batch_size,
        cfg.train.lr,
    )
    timed = plan_cli.pilot_config(cfg, minutes=3)
    used = plan_cli._seconds_since_process_start()  # the budget guard's clock already ran this long
    assert timed.train.max_gpu_hours == pytest.approx(0.05 + used / 3600, abs=2 / 3600)
    assert timed.train.max_steps == 40
    with pytest.raises(PlanError, match="metrics.warmup_steps=2"):
        plan_cli.pilot_config(cfg, steps=4)
    with pytest.raises(PlanError, match="not both"):
        plan_cli.pilot_config(cfg, steps=10, minutes=1)


def test_summary_of_a_known_log(tmp_path: Path) -> None:
    times = [3.0, 2.0, 1.0, 1.2, 0.8, 1.0, 1.4, 0.6]  # two warm-up steps, then six
    rows, real = [], 0
    for i, t in enumerate(times, start=1):
        real += 1000
        rows.append(
            {
                "step": i,
                "step_time_s": t,
                "real_tokens": real,
                "data_stall_share": 0.1 * (i % 2),
                "sustained_tokens_per_s": None,
                "peak_memory_gib": 0.1 * i,
            }
        )
    rows.insert(3, {"step": 3, "eval_loss": 1.0})  # rows without timings are ignored
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    wall = 20.0
    ledger = {
        "world_size": 1,
        "startup_seconds": 5.0,
        "checkpoint_seconds": 0.5,
        "wall_seconds": wall,
        "exit_reason": "finished",
    }
    (tmp_path / "ledger.jsonl").write_text(json.dumps(ledger) + "\n")
    s = pilot.summarise(tmp_path, warmup_steps=2, device="cpu", prepare_seconds=1.0, earlier_seconds=0.5)
    sustained = np.array(times[2:])
    assert (s["steps"], s["warmup_steps"]) == (8, 2)
    assert s["step_time_s"]["mean"] == pytest.approx(1.0)
    assert s["step_time_s"]["p50"] == pytest.approx(float(np.percentile(sustained, 50)))
    assert s["step_time_s"]["p10"] < s["step_time_s"]["p50"] < s["step_time_s"]["p90"]
    assert s["sustained_tokens_per_s"] == pytest.approx(1000.0)  # 6000 tokens in 6.0 s
    assert s["real_tokens_per_step"] == pytest.approx(1000.0)
    assert s["warmup_extra_seconds"] == pytest.approx(3.0 + 2.0 - 2 * 1.0)
    assert s["startup_seconds"] == pytest.approx(3.5) and s["save_seconds"] == 0.5
    assert s["teardown_seconds"] == pytest.approx((wall - 1.5) - 3.5 - sum(times) - 0.5)
    assert s["peak_memory_gib"] == pytest.approx(0.8) and s["data_stall_share"] == pytest.approx(0.05)
    with pytest.raises(PlanError, match="give more --steps"):
        pilot.summarise(tmp_path, warmup_steps=7, device="cpu")


def test_timed_pilot_stops_by_the_clock(cfg: config.RunConfig) -> None:
    run.prepare_data(cfg, progress=False)  # shared with the pilot: its clock then goes to model load and steps
    started = time.monotonic()
    result = plan_cli.run_pilot(cfg.replace(**{"train.max_steps": 10**6}), minutes=0.3, fresh_process=False)
    assert result["exit_reason"] == "budget" and result["steps"] > 5
    assert 0.3 * 60 <= time.monotonic() - started < 0.3 * 60 + 15  # stops at the first step past the budget


def test_tiny_pilot_end_to_end(cfg: config.RunConfig, capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_cli.run_pilot(cfg, steps=6, fresh_process=False)
    out = Path(cfg.output_dir) / "pilot"
    assert json.loads((out / "pilot.json").read_text()) == result
    assert (result["steps"], result["warmup_steps"], result["exit_reason"]) == (6, 2, "finished")
    assert result["sustained_tokens_per_s"] > 0 and result["save_seconds"] > 0 and result["startup_seconds"] > 0
    st = result["step_time_s"]
    assert 0 < st["p10"] <= st["p50"] <= st["p90"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000006"]  # exactly the one forced save
    assert not (Path(cfg.output_dir) / "checkpoints").exists()  # the real run's directory is untouched

    # `spotune estimate` finds pilot.json by default and forecasts on the device it ran on.
    args = argparse.Namespace(
        pilot=None,
        throughput=None,
        gpus=1,
        deadline_hours=None,
        budget=None,
        catalog=None,
        json=True,
        gpu=None,
        mfu=None,
    )
    assert plan_cli.estimate_command(cfg, args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["throughput"]["source"] == "pilot" and doc["data"]["exact"]
    row = next(o for o in doc["options"] if o["gpu"] == result["device"])
    assert row["tokens_per_s"] == pytest.approx(result["sustained_tokens_per_s"])
    # 40 steps, saves every 10, so 4 saves at the measured save time.
    assert row["checkpoint_hours"] == pytest.approx(4 * result["save_seconds"] / 3600)
