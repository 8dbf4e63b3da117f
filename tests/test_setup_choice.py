"""Which torch set-up installs, decided without downloading anything: a fake `nvidia-smi` on PATH
reports each driver, a fake system interpreter reports the torch it has (scripts/torch_choice.py)."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import config as C
from trainer.training import gpu_probe, process, run

REPO = Path(__file__).resolve().parents[1]
CHOICE = REPO / "scripts" / "torch_choice.py"


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _fake_smi(bin_dir: Path, cuda: str | None) -> None:
    """An nvidia-smi that lists an H100 whose driver supports CUDA `cuda` (None: no GPU)."""
    bin_dir.mkdir(exist_ok=True)
    if cuda is None:
        _executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'NVIDIA-SMI has failed: no devices' >&2\nexit 9\n")
        return
    _executable(
        bin_dir / "nvidia-smi",
        "#!/bin/sh\n"
        'if [ "$1" = "-L" ]; then echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)"; exit 0; fi\n'
        f'echo "| NVIDIA-SMI 570.00   Driver Version: 570.00   CUDA Version: {cuda}   |"\n',
    )


def _fake_python(tmp_path: Path, torch: dict | None) -> Path:
    body = f"echo '{json.dumps(torch)}'" if torch is not None else "echo 'ModuleNotFoundError: torch' >&2; exit 1"
    return _executable(tmp_path / "python-system", f"#!/bin/sh\n{body}\n")


def _choose(tmp_path: Path, cuda: str | None, torch: dict | None) -> tuple[int, dict[str, str], str]:
    _fake_smi(tmp_path / "bin", cuda)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    cmd = [sys.executable, str(CHOICE), "--system-python", str(_fake_python(tmp_path, torch))]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    values = {k: shlex.split(v)[0] if v else "" for k, v in (line.split("=", 1) for line in out.stdout.splitlines())}
    return out.returncode, values, out.stderr


def test_no_gpu_gets_the_cpu_build(tmp_path: Path) -> None:
    code, got, _ = _choose(tmp_path, None, None)
    assert code == 0 and got["CHOICE"] == "cpu" and got["INDEX"].endswith("/cpu") and got["SPEC"] == "torch==2.13.0"


@pytest.mark.parametrize("version, choice", [("2.13.0+cpu", "system"), ("2.11.0+cu130", "system"), ("2.9.1", "cpu")])
def test_no_gpu_and_a_torch_in_the_environment_reuses_it_if_recent_enough(
    tmp_path: Path, version: str, choice: str
) -> None:
    code, got, _ = _choose(tmp_path, None, {"version": version, "cuda": False, "built": None})
    assert code == 0 and got["CHOICE"] == choice
    if choice == "system":
        assert f"torch {version} satisfies torch>=2.11: reused, nothing downloaded" in got["WHY"]
    else:  # control: too old a torch is not reused, and the reason says so
        assert got["SPEC"] == "torch==2.13.0" and "torch 2.9.1 is older than torch>=2.11" in got["WHY"]


def test_a_system_torch_that_sees_the_gpu_is_reused(tmp_path: Path) -> None:
    code, got, _ = _choose(tmp_path, "13.0", {"version": "2.11.0+cu130", "cuda": True, "built": "13.0"})
    assert code == 0 and got["CHOICE"] == "system"
    assert "torch 2.11.0+cu130 (CUDA 13.0) already sees the NVIDIA H100 80GB HBM3" in got["WHY"]


@pytest.mark.parametrize(
    "cuda, torch, build, why",
    [
        ("12.2", None, "cu128", "no system torch"),  # an R535 box: 12.x minor-version compatibility
        ("12.8", {"version": "2.11.0+cpu", "cuda": False, "built": None}, "cu128", "does not see the GPU"),
        ("13.0", {"version": "2.9.1+cu130", "cuda": True, "built": "13.0"}, "cu130", "is older than torch>=2.11"),
    ],
)
def test_otherwise_the_build_the_driver_supports(tmp_path: Path, cuda: str, torch: dict | None, build: str, why: str):
    code, got, _ = _choose(tmp_path, cuda, torch)
    assert code == 0 and got["CHOICE"] == "cuda"
    assert got["INDEX"].endswith(f"/{build}") and got["SPEC"] == "torch>=2.11"
    assert why in got["WHY"] and f"CUDA {cuda}" in got["WHY"]


def test_a_driver_too_old_for_every_build_stops_with_the_fix(tmp_path: Path) -> None:
    code, got, err = _choose(tmp_path, "11.8", None)
    assert code == 3 and got == {}
    assert "supports CUDA 11.8, older than every torch build" in err and "Update the NVIDIA driver" in err


def test_the_floor_is_read_from_pyproject() -> None:
    sys.path.insert(0, str(CHOICE.parent))
    try:
        import torch_choice
    finally:
        sys.path.pop(0)
    assert torch_choice.torch_floor(REPO / "pyproject.toml") == (2, 11)


def test_train_refuses_the_cpu_of_a_gpu_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path / "bin", "12.2")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    reason = gpu_probe.unusable_gpu_reason()
    assert reason is not None and "nvidia-smi lists GPU 0: NVIDIA H100 80GB HBM3 but torch" in reason
    assert "rm -rf .venv && make setup" in reason
    with pytest.raises(C.ConfigError, match="training would run on the CPU"):
        process.make_accelerator(run.process_settings(C.load(None, [])))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU on purpose
    assert gpu_probe.unusable_gpu_reason() is None


def test_no_gpu_no_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path / "bin", None)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert gpu_probe.listed_gpus() == [] and gpu_probe.unusable_gpu_reason() is None
