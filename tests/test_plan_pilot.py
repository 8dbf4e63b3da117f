"""`spotune pilot`: its config, its summary maths on a known log, and one real tiny pilot."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pytest

from trainer import config
from trainer.cli import pilot_run, world
from trainer.cli.estimate import estimate_command
from trainer.cli.main import main as spotune
from trainer.plan import PlanError, pilot
from trainer.restart.books.clock import seconds_since_process_start
from trainer.training import inputs


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
    p = pilot_run.pilot_config(cfg, steps=7)
    assert p.output_dir == str(Path(cfg.output_dir) / "pilot")
    assert p.data.cache_dir == str(Path(cfg.output_dir) / "data")  # the run's own cache: prepared once
    assert (p.train.max_steps, p.checkpoint.resume, p.checkpoint.every_steps, p.metrics.log_every) == (
        7,
        "never",
        None,
        1,
    )
    assert p.train.eval_every == 7 and p.train.max_gpu_hours is None  # one evaluation, at the end, timed
    assert p.checkpoint.remote is None
    remote = pilot_run.pilot_config(cfg.replace(**{"checkpoint.remote": "s3://bucket/run/"}), steps=7)
    assert remote.checkpoint.remote == "s3://bucket/run/pilot"  # never where the real run resumes from
    assert (p.model, p.adapter, p.data.seq_len, p.train.micro_batch_size, p.train.lr) == (
        cfg.model,
        cfg.adapter,
        cfg.data.seq_len,
        cfg.train.micro_batch_size,
        cfg.train.lr,
    )
    timed = pilot_run.pilot_config(cfg, minutes=3)
    used = seconds_since_process_start()  # the budget guard's clock already ran this long
    assert timed.train.max_gpu_hours == pytest.approx(0.05 + used / 3600, abs=2 / 3600)
    assert pilot_run.pilot_config(cfg, minutes=3, used_seconds=0.0).train.max_gpu_hours == pytest.approx(0.05)
    assert timed.train.max_steps == 40
    with pytest.raises(PlanError, match="metrics.warmup_steps=2"):
        pilot_run.pilot_config(cfg, steps=4)
    with pytest.raises(PlanError, match="not both"):
        pilot_run.pilot_config(cfg, steps=10, minutes=1)


def _attempt_log(tmp_path: Path) -> None:
    """Two processes: steps 1-4 (stopped by SIGTERM after a save), then 5-8 after a resume."""
    times = [3.0, 1.0, 1.2, 0.8, 2.0, 1.4, 1.0, 0.6]  # each process: one warm-up step, then three
    rows, real = [], 0
    for i, t in enumerate(times, start=1):
        real += 1000 if i != 7 else 2000  # step 7 trains twice the tokens
        rows.append(
            {
                "step": i,
                "step_time_s": t,
                "real_tokens": real,
                "loss": 1.0,
                "attempt": 1 if i <= 4 else 2,
                "data_stall_share": 0.1 * (i % 2),
                "peak_memory_gib": 0.1 * i,
            }
        )
    rows.insert(3, {"step": 3, "eval_loss": 1.0, "eval_seconds": 0.7})  # rows without step times are no steps
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = {"imports": 4.0, "store": 0.0, "data": 6.0, "model": 2.0, "resolve": 0.0, "report": 0.5}
    second = {"imports": 5.0, "store": 0.0, "data": 0.25, "model": 3.0, "resolve": 0.1, "restore": 0.4}
    ledger = [
        {"attempt": 1, "world_size": 1, "startup_seconds": 13.0, "checkpoint_seconds": 0.5, "wall_seconds": 20.0,
         "exit_reason": "preempted", "phases": first, "data_reused": False},
        {"attempt": 2, "world_size": 1, "startup_seconds": 9.0, "checkpoint_seconds": 0.3, "wall_seconds": 18.0,
         "exit_reason": "finished", "phases": {**second, "final": 0.2, "flush": 0.0, "report": 0.6},
         "data_reused": True},
    ]  # fmt: skip
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger))
    (tmp_path / "checkpoints" / "step-000008").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-000008" / "adapter.safetensors").write_bytes(b"x" * 1234)


def test_summary_of_a_known_log(tmp_path: Path) -> None:
    _attempt_log(tmp_path)
    s = pilot.summarise(tmp_path, warmup_steps=1, device="cpu", outside_seconds={1: 21.0, 2: 18.5})
    sustained = np.array([1.0, 1.2, 0.8, 1.4, 1.0, 0.6])
    assert (s["steps"], s["warmup_steps"]) == (8, 2)  # one warm-up step per process
    assert s["step_time_s"]["mean"] == pytest.approx(1.0) and s["step_time_s"]["n"] == 6
    assert s["step_time_s"]["sd"] == pytest.approx(float(sustained.std(ddof=1)))
    assert s["step_time_s"]["p50"] == pytest.approx(float(np.percentile(sustained, 50)))
    # Both processes' means are 1.0: no spread between them beyond their step-to-step noise.
    assert s["step_time_s"]["between_sd"] == 0.0
    # 7000 tokens over 6.0 s of sustained steps, the step with twice the tokens included.
    assert s["sustained_tokens_per_s"] == pytest.approx(7000 / 6.0)
    assert s["warmup_extra_seconds"] == pytest.approx(((3.0 - 1.0) + (2.0 - 1.0)) / 2)
    a1, a2 = s["attempts"]
    assert a1["setup_seconds"] == pytest.approx(13.0 - 12.0) and a2["setup_seconds"] == pytest.approx(9.0 - 8.75)
    assert (a1["exit_seconds"], a2["exit_seconds"]) == (pytest.approx(1.0), pytest.approx(0.5))
    f = s["fixed"]
    assert (f["imports"], f["model"], f["data_prepare"], f["data_cache_hit"]) == (4.5, 2.5, 6.0, 0.25)
    assert (f["final"], f["report"], f["exit"]) == (0.2, 0.6, pytest.approx(0.75))  # the end of the finished process
    # The spread of what both processes pay alike: imports + model + set-up + exit.
    assert f["sd"] == pytest.approx(float(np.std([4 + 2 + 1 + 1.0, 5 + 3 + 0.25 + 0.5], ddof=1)))
    assert s["restart"] == {
        "startup_seconds": 9.0,
        "cold_start_extra_seconds": 0.0,  # 4 + 2 against 5 + 3: the first process loaded warm
        "resolve_seconds": 0.1,
        "restore_seconds": 0.4,
        "warmup_extra_seconds": pytest.approx(1.0),
        "data_reused": True,
    }
    assert s["save_seconds"] == pytest.approx(0.4) and s["checkpoint_bytes"] == 1234.0
    assert s["eval_seconds"] == 0.7 and s["peak_memory_gib"] == pytest.approx(0.8)
    # Control: a second process that ran slower shows up as spread between processes.
    slow = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in slow:
        if r.get("attempt") == 2:
            r["step_time_s"] *= 1.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in slow))
    assert pilot.summarise(tmp_path, warmup_steps=1, device="cpu")["step_time_s"]["between_sd"] > 0.2
    with pytest.raises(PlanError, match="give more --steps"):
        pilot.summarise(tmp_path, warmup_steps=4, device="cpu")


def test_a_cold_first_process_is_a_restarts_cost_not_the_next_runs(tmp_path: Path) -> None:
    """A pilot whose first process read torch and the weights from disk (a new machine): the run
    that follows on the warm machine pays the second process's loading; a replacement machine
    pays the difference again."""
    _attempt_log(tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    rows[0]["phases"].update(imports=17.0, model=5.0)  # 22 s against the second's 8: cold
    rows[0]["startup_seconds"] += 16.0
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = pilot.summarise(tmp_path, warmup_steps=1, device="cpu")
    assert (s["fixed"]["imports"], s["fixed"]["model"]) == (5.0, 3.0)
    assert s["restart"]["cold_start_extra_seconds"] == 14.0
    assert s["fixed"]["sd"] is None  # one warm process: no spread measured between warm ones
    # Control: 1.4x the second's loading is warm-process noise, averaged as before.
    rows[0]["phases"].update(imports=7.2, model=4.0)
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = pilot.summarise(tmp_path, warmup_steps=1, device="cpu")
    assert (s["fixed"]["imports"], s["fixed"]["model"]) == (pytest.approx(6.1), 3.5)
    assert s["restart"]["cold_start_extra_seconds"] == 0.0


def test_timed_pilot_stops_by_the_clock(cfg: config.RunConfig) -> None:
    inputs.prepare_data(cfg, progress=False)  # shared with the pilot: its clock then goes to model load and steps
    started = time.monotonic()
    # No report after the stop: its charts would only lengthen the time past the budget the bound below allows.
    timed = cfg.replace(**{"train.max_steps": 10**6, "metrics.report": False})
    result = pilot_run.run_pilot(timed, minutes=0.3, fresh_process=False)
    assert result["exit_reason"] == "budget" and result["steps"] > 5
    assert 0.3 * 60 <= time.monotonic() - started < 0.3 * 60 + 15  # stops at the first step past the budget


def test_tiny_pilot_end_to_end(cfg: config.RunConfig, capsys: pytest.CaptureFixture[str]) -> None:
    result = pilot_run.run_pilot(cfg, steps=6, fresh_process=False)
    out = Path(cfg.output_dir) / "pilot"
    assert json.loads((out / "pilot.json").read_text()) == result
    assert (result["steps"], result["warmup_steps"], result["exit_reason"]) == (6, 2, "finished")
    assert result["sustained_tokens_per_s"] > 0 and result["save_seconds"] > 0 and result["startup_seconds"] > 0
    st = result["step_time_s"]
    assert 0 < st["p10"] <= st["p50"] <= st["p90"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000006"]  # exactly the one forced save
    assert not (Path(cfg.output_dir) / "checkpoints").exists()  # the real run's directory is untouched

    # `spotune estimate` finds pilot.json by default and forecasts on the device it ran on.
    capsys.readouterr()  # the pilot's own lines (its data summary, its steps)
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
    assert estimate_command(cfg, args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["throughput"]["source"] == "pilot" and doc["data"]["exact"]
    row = next(o for o in doc["options"] if o["gpu"] == result["device"])
    assert row["tokens_per_s"] == pytest.approx(result["sustained_tokens_per_s"])
    # 40 steps, saves every 10, so 4 saves at the measured save time.
    assert row["checkpoint_hours"] == pytest.approx(4 * result["save_seconds"] / 3600)


@pytest.mark.slow
def test_cli_pilot_times_two_processes_and_a_restart(
    cfg: config.RunConfig, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`spotune pilot` runs the training as child processes, timed from outside: the first is
    stopped by SIGTERM halfway and the second resumes, so exit and a restart are measured too.
    The command runs in this process (the processes it times are its children all the same);
    capfd reads what it and its children write to this process's stdout and stderr."""
    cfg = cfg.replace(**{"data.eval_fraction": 0.1})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(config.to_yaml(cfg))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the pilot's processes
    code = spotune(["pilot", str(recipe), "--steps", "10"])
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    # What it prints: the data summary once (the resumed process reuses the data: two brief lines), its own
    # planned stop said as such, never "preempted"; no datasets progress bar off a terminal.
    said = out + err
    assert said.count("spotune prepare: built dataset") == 1 and said.count("reused cached dataset") == 1, said
    assert "spotune: stopped as planned at step 5/10" in said and "spotune: preempted" not in said
    assert "examples/s]" not in said and "\r" not in said
    p = json.loads((Path(cfg.output_dir) / "pilot" / "pilot.json").read_text())
    assert [a["exit_reason"] for a in p["attempts"]] == ["preempted", "finished"]
    assert [a["steps"] for a in p["attempts"]] == [5, 5]  # the planned stop: exactly halfway
    for a in p["attempts"]:
        assert a["outside_seconds"] >= a["wall_seconds"] > a["startup_seconds"] > 0
        assert a["exit_seconds"] == pytest.approx(a["outside_seconds"] - a["wall_seconds"])
    assert p["attempts"][0]["data_reused"] is False and p["attempts"][1]["data_reused"] is True
    assert p["restart"] is not None and p["restart"]["restore_seconds"] > 0
    assert p["eval_seconds"] is not None and p["eval_seconds"] > 0  # the recipe evaluates: one timed evaluation
    assert p["step_time_s"]["between_sd"] is not None
    # The spread of a start-up needs two warm processes: a first one that loaded cold (a busy or fresh
    # machine) is a restart's cost instead, and then one process is left to measure it.
    cold = p["restart"]["cold_start_extra_seconds"] > 0
    assert (p["fixed"]["sd"] is None) == cold, (p["fixed"], p["restart"])
    # The forecast for a new directory: every fixed cost measured, the data prepared there.
    fresh = cfg.replace(output_dir=str(tmp_path / "elsewhere"))
    doc = world.estimate_for_run(fresh, pilot_json=Path(cfg.output_dir) / "pilot" / "pilot.json")
    items = {i["name"]: i for i in doc["timeline"]["attempt"]}
    assert items["data: prepare (no cache in the target directory)"]["source"] == "pilot"
    assert items["interpreter exit"]["source"] == "pilot" and items["interpreter exit"]["seconds"] > 0
    assert doc["data"]["exact"]  # counted from the pilot's manifest, though `elsewhere` has no cache
    # ... and for the run's own directory, which shares the pilot's cache: a hit.
    own = {i["name"] for i in world.estimate_for_run(cfg, pilot_json=None)["timeline"]["attempt"]}
    assert "data: cache hit" in {
        i["name"]
        for i in world.estimate_for_run(cfg, pilot_json=Path(cfg.output_dir) / "pilot" / "pilot.json")["timeline"][
            "attempt"
        ]
    }
    assert "start-up and teardown" in own  # control: without the pilot it is one assumed figure
