"""`make gpu-check` keeps working: its CPU dry path runs every part and writes the summary and JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_dry_run_passes_every_part_and_writes_both_files(tmp_path: Path) -> None:
    out = tmp_path / "check"
    cmd = [sys.executable, "scripts/gpu_check.py", "--dry", "--out", str(out)]
    cmd += ["--only", "environment", "gpu-tests", "exit-paths", "resume-drill"]  # benchmark --tiny: test_gpu_bench.py
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert f"gpu-check: wrote {out / 'gpu-check.md'}" in done.stdout
    result = json.loads((out / "gpu-check.json").read_text())
    assert result["dry"] is True
    assert {k: v["status"] for k, v in result["parts"].items()} == {
        "environment": "pass",
        "gpu-tests": "pass",
        "exit-paths": "pass",
        "resume-drill": "pass",
    }
    drill = result["parts"]["resume-drill"]["figure"]
    assert "SIGKILL after the step-4 checkpoint, resumed there" in drill and "['killed', 'finished']" in drill
    assert "tests collected" in result["parts"]["gpu-tests"]["figure"]
    md = (out / "gpu-check.md").read_text()
    assert "| resume-drill | pass |" in md and "All parts passed." in md


def test_a_failing_part_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    """Control: a part that fails (an exit-paths run pointed at a test id that does not exist) makes
    the command exit 1 and is named, while the next part still runs."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)

    def broken(args, part):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    parts = dict(gpu_check.PARTS)
    try:
        gpu_check.PARTS.clear()
        gpu_check.PARTS.update({"broken": broken, "environment": parts["environment"]})
        code = gpu_check.main(["--dry", "--out", str(tmp_path)])
    finally:
        gpu_check.PARTS.clear()
        gpu_check.PARTS.update(parts)
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert code == 1
    assert result["parts"]["broken"] == {"status": "fail", "figure": "RuntimeError: boom", "seconds": 0.0, "log": ""}
    assert result["parts"]["environment"]["status"] == "pass"
    assert "Failed: broken" in (tmp_path / "gpu-check.md").read_text()


def _gpu_check() -> Any:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


@pytest.mark.parametrize(
    "summary, status",
    [
        ("===== 14 skipped, 880 deselected in 3.10s =====", "fail"),  # no GPU seen: every test skipped
        ("===== 12 passed, 2 skipped, 880 deselected in 93.10s =====", "pass"),
        ("===== 1 failed, 11 passed in 93.10s =====", "fail"),
    ],
)
def test_a_gpu_run_where_every_test_skipped_is_not_a_pass(
    monkeypatch: pytest.MonkeyPatch, summary: str, status: str
) -> None:
    gpu_check = _gpu_check()
    code = 1 if "failed" in summary else 0  # pytest's own exit code: 0 when everything skipped
    monkeypatch.setattr(gpu_check, "_run", lambda cmd, timeout, env=None: (code, f"...\n{summary}\n"))
    part = gpu_check.Part("gpu-tests")
    gpu_check.gpu_tests(argparse.Namespace(dry=False, budget=gpu_check.BUDGET_S), part)
    assert part.status == status, part.figure
    if "14 skipped" in summary:
        assert "no GPU test ran (14 skipped, 880 deselected)" in part.figure
