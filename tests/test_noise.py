"""No library noise reaches the user of `spotune train`; warnings that matter still do."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from trainer.model.load import peft_wrapping

REPO = Path(__file__).resolve().parents[1]

NOISE = (
    "is_gradient_checkpointing",  # transformers 5 FutureWarning, asked by peft
    "FutureWarning",
    "Loading weights",  # transformers' own progress bar
    "Writing model shards",
    "gemm_4bit_forward",  # bitsandbytes, imported by peft on a plain LoRA run
    "kernels-community",
    '{"sustained_tokens_per_s"',  # the raw JSON dict the run used to end with
    "examples/s]",  # datasets' progress bars, in a log file one line of carriage returns
    "\r",
)


def test_tiny_recipe_prints_no_library_noise(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "train",
        str(REPO / "recipes" / "tiny-cpu.yaml"),
        f"output_dir={tmp_path / 'run'}",
        "train.max_steps=2",
        "train.warmup_steps=0",
        "data.seq_len=128",
        "model.gradient_checkpointing=true",  # the path where peft asks the deprecated name
        "metrics.log_every=1",
        "metrics.warmup_steps=0",
        "metrics.price_per_hour=1.0",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "default"}  # show every warning once
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    for noise in NOISE:
        assert noise not in text, f"{noise!r} leaked:\n{text}"
    # control: what the user should see does reach the same streams
    assert "spotune: finished at step 2/2" in text
    assert "final loss" in text and f"adapter: {tmp_path / 'run' / 'final'}" in text
    assert "device-hours" in text and "GPU-hours" not in text  # a CPU run's hours are not GPU-hours
    assert "at seq_len 128 (in use): " in text  # what seq_len loses, before training


def test_only_the_cpu_kernel_notice_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger="bitsandbytes.backends.cpu.ops"):
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s.", "no module")
        log.warning("CUDA SETUP: something that matters")
    assert [r.getMessage() for r in caplog.records] == ["CUDA SETUP: something that matters"]


def test_peft_wrapping_keeps_other_warnings() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with peft_wrapping():
            warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning, stacklevel=1)
            warnings.warn("a FutureWarning about the user's own settings", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["a FutureWarning about the user's own settings"]
