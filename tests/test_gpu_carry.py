"""What goes to a GPU box without a network (scripts/gpu_carry.py): the check's packages and what they
require that the target lacks, walked from each wheel's own metadata; never torch's CUDA stack; the
carry folder under its size cap. A fake index (hand-made wheels) stands in for PyPI."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from test_gpu_check import _wheel

REPO = Path(__file__).resolve().parents[1]

# name -> (version, Requires-Dist lines): the shapes of the real packages' metadata
INDEX: dict[str, tuple[str, tuple[str, ...]]] = {
    "bitsandbytes": ("0.50.2", ("torch<3,>=2.4", "numpy>=1.17", "packaging>=20.9")),
    "liger-kernel": ("0.8.5", ("torch>=2.1.2", "triton>=2.3.1")),
    "datasets": (
        "5.2.0",
        (
            "pyarrow>=24.0.0",
            "dill<0.4.2,>=0.3.0",
            "multiprocess<0.70.20",
            "fsspec<=2026.9.0",
            'pytest; extra == "tests"',
        ),
    ),
    "dill": ("0.4.1", ()),
    "multiprocess": ("0.70.19", ("dill>=0.4.1",)),
    "pywin32-ctypes": ("1.0", ()),
    "transformers": ("5.24.0", ("huggingface-hub>=1.0", 'pywin32-ctypes; sys_platform == "win32"')),
    "huggingface-hub": ("2.4.0", ()),
}


@pytest.fixture
def carry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """scripts/gpu_carry.py whose downloads come from INDEX, each recorded."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_carry
    finally:
        sys.path.pop(0)
    asked: list[str] = []

    def download(requirement: str, dest: Path, python: str = "3.12") -> Path:
        asked.append(requirement)
        name = gpu_carry.Requirement(requirement).name
        version, requires = INDEX[name]
        return _wheel(dest, name.replace("-", "_"), version, requires)

    monkeypatch.setattr(gpu_carry, "download", download)
    gpu_carry.asked = asked
    return gpu_carry


def test_the_carry_is_what_the_image_lacks_walked_from_each_wheel(carry: Any, tmp_path: Path) -> None:
    image = {"numpy", "packaging", "pyarrow", "fsspec", "torch", "triton"}
    wheels = carry.fetch_wheels(
        tmp_path / "w", [("bitsandbytes", ""), ("liger-kernel", ""), ("datasets", "")], image.__contains__
    )
    names = [w["wheel"].split("-")[0] for w in wheels]
    assert names == ["bitsandbytes", "liger_kernel", "datasets", "dill", "multiprocess"]  # no pytest: an extra's
    assert wheels[3]["why"] == "required by datasets (dill<0.4.2,>=0.3.0), not on the target"
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "w").glob("*.whl")) == sorted(names)
    # control: an image without torch: the walk refuses rather than carry torch's CUDA stack
    with pytest.raises(SystemExit, match="requires torch, which is never carried"):
        carry.fetch_wheels(tmp_path / "x", [("bitsandbytes", "")], {"numpy", "packaging"}.__contains__)


def test_the_torchless_wheel_folder_skips_torch_and_what_only_it_needs(carry: Any, tmp_path: Path) -> None:
    """scripts/fetch_wheels.sh's default: spotune's requirements but torch, triton and nvidia-*."""
    wheels = carry.fetch_wheels(
        tmp_path / "w", [("transformers", ">=5.0"), ("liger-kernel", "")], lambda n: bool(carry.NEVER.match(n))
    )
    assert [w["wheel"].split("-")[0] for w in wheels] == ["transformers", "liger_kernel", "huggingface_hub"]
    assert not any(a.startswith(("torch", "triton", "nvidia")) for a in carry.asked)  # pywin32: not on Linux
    top = dict(carry.project_top(["gpu"]))  # the real requirement list, torch taken out before any download
    assert "torch" not in top and top["liger-kernel"] == ">=0.5" and top["transformers"] == "<6,>=5.0"
    assert "setuptools" in top and "pytest" not in top  # the test extra only when asked


def test_the_folder_holds_run_sh_the_data_and_stays_under_the_cap(
    carry: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(carry, "CARRY", ["datasets"])
    dest = tmp_path / "carry"
    assert carry.main(["--dest", str(dest)]) == 0
    assert (dest / "run.sh").read_text() == (REPO / "scripts" / "gpu_carry_run.sh").read_text()
    assert (dest / "run.sh").stat().st_mode & 0o111
    manifest = json.loads((dest / "carry.json").read_text())
    assert [w["wheel"].split("-")[0] for w in manifest["wheels"]] == ["datasets", "dill", "multiprocess"]
    if (carry.SHARED / "gpteacher-roleplay.json").exists():
        assert len(json.loads((dest / "data" / "gpteacher-roleplay.json").read_text())) == carry.DATA_ROWS
        assert (dest / "data" / "llama2-tokenizer" / "tokenizer.json").is_file()
    own, total = carry.travelling_bytes(dest)
    assert 0 < own < total
    monkeypatch.setattr(carry, "LIMIT_MIB", total / carry.MIB / 2)  # control: over the cap fails
    assert carry.main(["--dest", str(dest)]) == 1
