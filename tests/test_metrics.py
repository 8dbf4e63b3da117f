"""trainer/training/metrics.py: the meter's arithmetic and the sinks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.training import metrics, telemetry


def _meter(**kw) -> metrics.Meter:
    defaults = dict(
        world_size=2,
        warmup_steps=2,
        flops_fn=lambda tokens, sq, head: 10.0 * tokens,
        peak_flops=100.0,
        price_per_hour=3.6,
        device_seconds_fn=lambda: 7200.0,
    )
    defaults.update(kw)
    return metrics.Meter(**defaults)


def test_window_sustained_mfu_and_cost() -> None:
    m = _meter()
    for step, seconds, stall, tokens in [
        (0, 4.0, 1.0, 100),
        (1, 2.0, 0.0, 100),
        (2, 1.0, 0.5, 100),
        (3, 1.0, 0.0, 300),
    ]:
        m.step(step, seconds, stall, tokens, 0)
    m.pause(30.0)  # a checkpoint: excluded from every rate
    row = m.row(step=4, loss=1.5)
    assert row["step"] == 4 and row["loss"] == 1.5
    assert row["tokens_per_s"] == pytest.approx(600 / 8.0)
    assert row["sustained_tokens_per_s"] == pytest.approx(400 / 2.0), "steps 0 and 1 are warm-up"
    assert row["step_time_s"] == pytest.approx(2.0)
    assert row["data_stall_share"] == pytest.approx(1.5 / 8.0)
    assert row["mfu"] == pytest.approx(6000 / (8.0 * 2 * 100.0))
    assert row["sustained_mfu"] == pytest.approx(4000 / (2.0 * 2 * 100.0))
    assert row["device_hours"] == pytest.approx(2.0) and row["cost"] == pytest.approx(7.2)
    # the window resets; the sustained figures do not
    m.step(4, 2.0, 0.0, 200, 0)
    row = m.row(step=5)
    assert row["tokens_per_s"] == pytest.approx(100.0)
    assert row["sustained_tokens_per_s"] == pytest.approx(600 / 4.0)


def test_mfu_null_without_peak_and_cost_null_without_price() -> None:
    m = _meter(peak_flops=None, price_per_hour=None)
    m.step(0, 1.0, 0.0, 10, 0)
    row = m.row(step=1)
    assert row["mfu"] is None and row["cost"] is None and row["tokens_per_s"] == 10.0


def test_projected_total_cost() -> None:
    m = _meter(total_steps=10, warmup_steps=1)  # 2 devices at 3.6 per device-hour; 7200 device-s so far
    assert m.row(step=0)["projected_cost"] is None  # no step timed yet
    m.step(0, 9.0, 0.0, 10, 0)  # warm-up: used only until a sustained step exists
    assert m.projected_cost(1) == pytest.approx(7.2 + 9 * 9.0 * 2 / 3600 * 3.6)
    m.step(1, 5.0, 0.0, 10, 0)
    m.step(2, 3.0, 0.0, 10, 0)
    # cost so far (7200 s x 3.6 / 3600) + 7 remaining steps x 4 s x 2 devices at 3.6 per hour
    assert m.row(step=3)["projected_cost"] == pytest.approx(7.2 + 7 * 4.0 * 2 / 3600 * 3.6)
    assert _meter(price_per_hour=None, total_steps=10).projected_cost(3) is None


def test_flops_get_the_document_lengths_and_head_tokens() -> None:
    got: list[tuple[float, float, float]] = []
    m = _meter(flops_fn=lambda tokens, sq, head: got.append((tokens, sq, head)) or 1.0, warmup_steps=0)
    m.step(0, 1.0, 0.0, 30, 500)
    m.step(1, 1.0, 0.0, 30, 500, head_tokens=12)
    assert got == [(30, 500, 30), (30, 500, 12)]  # the head defaults to every real token


def test_own_clock_counts_devices() -> None:
    m = metrics.Meter(world_size=4, warmup_steps=0, prior_device_seconds=3600.0)
    assert 3600.0 <= m.device_seconds() < 3600.0 + 4 * 60


def test_peak_flops_resolution() -> None:
    cpu = torch.device("cpu")
    assert metrics.resolve_peak_flops(None, None, cpu) is None
    assert metrics.resolve_peak_flops(123.0, "H100-SXM", cpu) == 123.0
    assert metrics.resolve_peak_flops(None, "H100-SXM", cpu) > 5e14
    with pytest.raises(ValueError, match="metrics.gpu"):
        metrics.resolve_peak_flops(None, "no-such-gpu-9000", cpu)


def test_peak_memory_on_cpu_is_rss() -> None:
    assert metrics.peak_memory_bytes() > 10 * 2**20


def test_jsonl_sink_writes_non_finite_as_strings(tmp_path: Path) -> None:
    sink = telemetry.JsonlSink(tmp_path / "m" / "metrics.jsonl")
    sink.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "mfu": None})
    sink.write({"step": 2, "loss": 1.0})
    sink.close()
    rows = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": "nan", "grad_norm": "inf", "mfu": None}, {"step": 2, "loss": 1.0}]
