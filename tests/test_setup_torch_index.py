"""setup.sh on a GPU box without a usable torch: torch comes from its CUDA build's index alone, so a
newer release on PyPI (built for another CUDA than the driver runs) can never win; its
dependencies come after, with the build pinned. A fake venv interpreter records each pip call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_setup_choice import _executable, _fake_smi

REPO = Path(__file__).resolve().parents[1]


def _setup(tmp_path: Path, installed: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    _fake_smi(tmp_path / "bin", "12.4")  # an R550 box: the cu128 build
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls"
    _executable(
        venv / "bin" / "python",
        "#!/bin/sh\n"
        f'echo "$*" >> {log}\n'
        'case "$*" in\n'
        '  "-c import torch") exit 1 ;;\n'  # no torch in the venv yet
        f'  *importlib.metadata*) echo "{installed}" ;;\n'
        "esac\n",
    )
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "VENV": str(venv),
        "PYTHON": sys.executable,  # its torch does not see a GPU: the CUDA build is chosen
    }
    done = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], env=env, capture_output=True, text=True)
    return done, log.read_text().splitlines()


def test_torch_comes_from_its_build_index_alone_then_its_dependencies(tmp_path: Path) -> None:
    done, calls = _setup(tmp_path, "2.13.0+cu128")
    assert done.returncode == 0, done.stderr
    installs = [c for c in calls if " install " in c and "torch" in c and "-e" not in c.split()]
    assert installs[0].endswith("install --no-deps torch>=2.11 --index-url https://download.pytorch.org/whl/cu128")
    assert "--extra-index-url" not in installs[0]
    assert "torch==2.13.0+cu128 --index-url https://download.pytorch.org/whl/cu128" in installs[1]
    # A GPU machine's runtime with the `gpu` extra (Liger's loss is CUDA's default), not the test tools.
    assert sum(c.endswith(" -e .[gpu]") for c in calls) == 1 and not any("test" in c for c in calls)


@pytest.mark.parametrize("installed", ["2.16.0", "2.16.0+cu130"])
def test_a_torch_of_another_build_stops_setup_with_the_fix(tmp_path: Path, installed: str) -> None:
    done, _ = _setup(tmp_path, installed)
    assert done.returncode == 3
    assert f"installed torch {installed}, not a cu128 build" in done.stderr and "--index-url" in done.stderr
