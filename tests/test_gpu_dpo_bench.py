"""benchmarks/gpu_dpo.py keeps working: its --tiny CPU run times spotune's DPO step and TRL's on the same pairs
and writes the JSON a GPU measurement will fill in (docs/gpu.md). Its `main` runs in this process (the test reads
the JSON and the printout; a subprocess would pay ~7 s of imports), as tests/test_preference_trl.py runs TRL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_dpo_benchmark_tiny_run_writes_its_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("trl", reason="TRL is the peer compared against: the `bench` extra")
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU path even on a GPU runner
    import gpu_dpo

    out = tmp_path / "bench.json"
    gpu_dpo.main(["--tiny", "--json", str(out), "--steps", "2", "--pairs", "4"])
    stdout = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert set(result) == {"device", "spotune", "trl", "setup"}
    for side in ("spotune", "trl"):
        assert set(result[side]) == {
            "pairs_per_s",
            "tokens_per_s",
            "step_seconds",
            "mfu",
            "peak_memory_gib",
            "first_step_seconds",
        }
        assert result[side]["pairs_per_s"] > 0 and result[side]["mfu"] is None  # no peak FLOP/s on CPU
    assert "pairs/s ratio spotune / TRL" in stdout
