"""The command line as users meet it: entry points, exit codes, one-sentence errors."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.cli.main import main

REPO = Path(__file__).resolve().parents[1]


def test_python_m_trainer_is_the_spotune_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "trainer", "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0
    for command in ("prepare", "inspect", "train", "estimate", "pilot", "export", "config"):
        assert command in out.stdout
    script = shutil.which("spotune", path=str(Path(sys.executable).parent))
    assert script is not None, "the console script `spotune` is installed with the package"


def test_bad_data_exits_2_naming_file_and_line(
    tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "broken.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": \n')
    code = main(
        [
            "prepare",
            f"output_dir={tmp_path / 'run'}",
            f"data.path={data}",
            f"model.name_or_path={tiny_llama}",
            "data.seq_len=64",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"{data}:2" in err or (str(data) in err and "line 2" in err), err
    assert "Traceback" not in err
    assert not any((tmp_path / "run" / "data").glob("*/manifest.json")), "a failed prepare leaves no cache"


def test_overrides_without_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "train.max_steps=9", "data.seq_len=128"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 9" in out and "seq_len: 128" in out
