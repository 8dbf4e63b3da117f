"""benchmarks/gpu_memory.py keeps working: its --tiny CPU runs print the memory table and the
longest-sequence search, and write the JSON the GPU memory figures (docs/gpu.md) are made from.

The tiny runs call its `main` in this process (a subprocess would pay ~7 s of imports each); the
8B estimate runs it as the command docs/long-context.md shows, which proves the script itself starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    """benchmarks/gpu_memory.py's `main` with `--tiny` and these arguments, in this process: the JSON it wrote
    and what it printed."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU path even on a GPU runner
    import gpu_memory

    def tiny(*extra: str) -> tuple[dict, str]:
        out = tmp_path / "bench.json"
        capsys.readouterr()
        gpu_memory.main(["--tiny", "--json", str(out), *extra])
        return json.loads(out.read_text()), capsys.readouterr().out

    return tiny


def test_memory_table_tiny_run(run: Any) -> None:
    result, stdout = run("--steps", "2", "--seqs", "64")
    rows = result["memory_table"]
    # LoRA and QLoRA x (no checkpointing, checkpointing, checkpointing + offloading) x one length.
    assert [(r["method"], r["checkpointing"], r["offload"]) for r in rows] == [
        (m, c, o) for m in ("lora", "qlora") for c, o in ((False, False), (True, False), (True, True))
    ]
    for r in rows:
        assert r["estimate"]["reserved"] >= r["estimate"]["allocated"] > 0 and r["tokens_per_s"] > 0
        assert r["allocated_gib"] is None  # CPU: no caching allocator to read
        assert (r["offloaded_gib"] > 0) == r["offload"]  # the hooks ran where offloading is on
    assert "e/res" in stdout and stdout.count("ckpt+offload") == 2


def test_longest_search_tiny_run(run: Any) -> None:
    result, stdout = run("--longest")
    found = result["longest"]
    assert found["measured_longest"] == 512  # the tiny run's cap
    assert found["estimated_longest"] > 512 and found["published_target"] == 342_000
    assert found["tiled_mlp"] and found["estimated_longest"] >= found["estimated_longest_without_tiling"]
    assert found["estimated_host_gib"] > 0 and found["assumed_h100_tokens_per_s"] > 0
    assert "longest 8B QLoRA r32 sequence" in stdout and "tiling (norms, MLP)" in stdout


def test_one_probe_at_a_given_length_tiny_run(run: Any) -> None:
    """`--probe SEQ` (the GPU check's `longest` slice): one step at that length, beside the estimate there."""
    result, stdout = run("--probe", "512")
    probe = result["probe"]
    assert probe["seq"] == 512 and probe["tiled_mlp"] and probe["tokens_per_s"] > 0 and probe["seconds"] > 0
    assert probe["offloaded_gib"] > 0 and probe["estimate"]["allocated"] > 0 and "error" not in probe
    assert "8B QLoRA r32, one 512-token row: fits" in stdout


def test_longest_estimate_of_the_8b_shape_on_cpu(tmp_path: Path) -> None:
    """The estimate's figures for the real Llama-3.1-8B shape need no GPU (docs/long-context.md quotes them)."""
    out = tmp_path / "longest.json"
    cmd = [sys.executable, "benchmarks/gpu_memory.py", "--longest", "--estimate-only", "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(out.read_text())["longest"]
    assert found["measured_longest"] is None and found["device_memory_gib"] == 79.1
    assert found["estimated_longest"] == 555_008 and found["estimated_longest_without_tiling"] == 257_024
    layers, hidden = 32, 4096  # offloaded: 30 layer inputs + the (tiled) final norm's input, all bf16
    assert found["estimated_host_gib"] * GIB == (layers - 2) * 2 * hidden * 555_008 + 2 * hidden * 555_008
