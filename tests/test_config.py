"""Config schema: YAML + overrides, every problem reported at once, fingerprint stability."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainer import config as C
from trainer.cli.main import main


def test_public_keys_exist_with_their_names() -> None:
    keys = {k for k, _, _ in C.field_docs()}
    required = {
        "output_dir",
        "seed",
        "model.name_or_path",
        "data.path",
        "data.format",
        "data.seq_len",
        "train.max_steps",
        "train.micro_batch_size",
        "train.grad_accum",
        "checkpoint.every_steps",
    }
    assert required <= keys
    assert all(doc for key, _, doc in C.field_docs() if key in required - {"seed"})


def test_yaml_and_overrides(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("output_dir: out\ndata:\n  seq_len: 512\ntrain:\n  lr: 2e-4\n")
    cfg = C.load(recipe, ["data.seq_len=1024", "adapter.target_modules=[q_proj, v_proj]", "train.max_steps=7"])
    assert cfg.output_dir == "out"
    assert cfg.data.seq_len == 1024  # the command line wins over the recipe
    assert cfg.train.lr == 2e-4  # `2e-4` is a string to PyYAML; the schema still reads a number
    assert cfg.adapter.target_modules == ("q_proj", "v_proj")
    assert cfg.train.max_steps == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 3  # type: ignore[misc]  # frozen


def test_all_problems_reported_at_once_with_suggestions(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(
        "modle:\n  name_or_path: x\ntrain:\n  micro_batch_size: two\n  lr: -1\ncheckpoint:\n  keep_last: 1\n"
    )
    with pytest.raises(C.ConfigError) as err:
        C.load(recipe, ["data.seq_lenn=5", "model.dtype=float64"])
    msg = str(err.value)
    assert str(recipe) in msg
    assert "modle: unknown key; did you mean model?" in msg
    assert "data.seq_lenn: unknown key; did you mean data.seq_len?" in msg
    assert "train.micro_batch_size: expected an integer or one of 'auto', got 'two'" in msg
    assert "model.dtype: expected one of 'float32', 'bfloat16', 'float16', got 'float64'" in msg
    assert "train.lr: must be above 0" in msg
    assert "checkpoint.keep_last: must be at least 2" in msg
    assert len(err.value.problems) == 6


def test_bad_yaml_names_the_line(tmp_path: Path) -> None:
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("train:\n  max_steps: 3\n   lr: [\n")
    with pytest.raises(C.ConfigError, match=r"invalid YAML at line 3"):
        C.load(recipe)


def test_cross_field_checks() -> None:
    with pytest.raises(C.ConfigError, match="train.max_cost: needs metrics.price_per_hour"):
        C.load(None, ["train.max_cost=10"])
    with pytest.raises(C.ConfigError, match="override 'nonsense' is not of the form key.sub=value"):
        C.load(None, ["nonsense"])


def test_fingerprint_covers_structure_not_run_length() -> None:
    base = C.load(None)
    fp = C.fingerprint(base)
    assert C.fingerprint(base.replace(**{"train.max_steps": 1000, "checkpoint.every_steps": 5})) == fp
    for key, value in [
        ("data.seq_len", 1024),
        ("adapter.r", 8),
        ("model.name_or_path", "other"),
        ("train.grad_accum", 2),
        ("data.path", "x.jsonl"),
    ]:
        assert C.fingerprint(base.replace(**{key: value})) != fp, key
    assert C.fingerprint(base, world_size=2) != fp  # global batch changes with the world size
    diff = C.diff_structural(C.structural_fields(base), C.structural_fields(base.replace(**{"adapter.r": 8})))
    assert diff == ["adapter.r: 16 -> 8"]


def test_cli_reports_config_errors_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "train.max_stesp=3"]) == 2
    assert "did you mean train.max_steps?" in capsys.readouterr().err
    assert main(["config", "--reference"]) == 0
    assert "checkpoint.every_steps" in capsys.readouterr().out
