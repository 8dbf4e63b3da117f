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


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"spotune {version('spotune')}\n"


@pytest.mark.parametrize(
    ("argv", "answer"),
    [
        (
            ["train", "recipes/tiny-cpu.yaml", "--max-steps", "10"],
            "--max-steps 10: settings are key=value overrides: write train.max_steps=10",
        ),
        (["train", "--max-steps", "10", "recipes/tiny-cpu.yaml"], "write train.max_steps=10"),  # before the recipe too
        (["prepare", "--seq-len=512"], "--seq-len=512: settings are key=value overrides: write data.seq_len=512"),
        (["train", "--learning-rate", "1e-4"], "write train.lr=1e-4 (learning_rate is its name elsewhere)"),
        (["estimate", "x", "--train.epochs", "2"], "write train.epochs=2"),
        (
            ["train", "--save_steps", "50"],
            "for steps alone set checkpoint.every_steps=50 checkpoint.every_minutes=null",
        ),
        (["train", "--max-stepz", "3"], "no setting of that name; the nearest keys: train.max_steps"),
    ],
)
def test_a_flag_that_looks_like_a_key_is_answered_with_the_override(
    argv: list[str], answer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert answer in err and "unrecognized arguments" not in err, err


def test_options_and_their_abbreviations_still_parse(capsys: pytest.CaptureFixture[str]) -> None:
    """Control: the command's own options (and argparse's unique prefixes) are not taken for keys."""
    with pytest.raises(SystemExit):
        main(["estimate", "--thr", "5", "--help"])
    assert "--throughput" in capsys.readouterr().out


def test_a_misspelt_format_gets_the_nearest_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "data.format=sharegtp"]) == 2
    assert "got 'sharegtp'; did you mean 'sharegpt'?" in capsys.readouterr().err
    assert main(["config", "data.format=sharegpt"]) == 0  # control


def test_a_model_that_is_no_folder_nor_hub_id_is_named_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    for command in ("prepare", "train", "pilot", "inspect"):
        assert main([command, f"output_dir={run}", f"model.name_or_path={tmp_path / 'no-such-model'}"]) == 2
        err = capsys.readouterr().err
        assert (
            f"model.name_or_path: {tmp_path / 'no-such-model'} is neither a local folder (no such directory) nor a hub"
            in err
        )
        assert "tokenizer" not in err and "Repo id" not in err
    assert not run.exists(), "refused before anything was written"


def test_offline_a_hub_id_not_in_the_cache_fails_before_anything_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    cache = tmp_path / "hf"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    assert main(["train", f"output_dir={run}", "model.name_or_path=org/not-cached"]) == 2
    err = capsys.readouterr().err
    assert "model.name_or_path: org/not-cached is not a local folder, and as a hub id it is not in" in err
    assert (
        str(cache) in err and "HF_HUB_OFFLINE=1 forbids downloading it" in err and "hf download org/not-cached" in err
    )
    assert not run.exists()
    # Control: once the cache holds it (the hub cache's layout), the check lets it through.
    snapshot = cache / "models--org--not-cached" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--org--not-cached" / "refs").mkdir()
    (cache / "models--org--not-cached" / "refs" / "main").write_text("a" * 40)
    from trainer import config as C
    from trainer.cli.recipe import check_model

    check_model(C.load(None, ["model.name_or_path=org/not-cached"]))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    check_model(C.load(None, ["model.name_or_path=org/elsewhere"]))  # online, the download is the loader's
