"""Planning without a download: shipped config.json files, the model-id form of `estimate`, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from trainer.model import flops
from trainer.plan import PlanError
from trainer.plan.models import load_config, looks_like_model_id, shipped_config, shipped_ids

REPO = Path(__file__).resolve().parents[1]

# Published parameter counts (model cards, or the exact count where the publisher gives one).
PUBLISHED = {
    "meta-llama/Llama-3.1-8B": 8.03e9,
    "meta-llama/Llama-3.1-70B": 70.6e9,
    "meta-llama/Llama-3.2-1B": 1.24e9,
    "meta-llama/Llama-3.2-3B": 3.21e9,
    "Qwen/Qwen2.5-0.5B": 0.494e9,
    "Qwen/Qwen2.5-1.5B": 1.54e9,
    "Qwen/Qwen2.5-3B": 3.09e9,
    "Qwen/Qwen2.5-7B": 7.62e9,
    "Qwen/Qwen2.5-14B": 14.7e9,
    "Qwen/Qwen2.5-72B": 72.7e9,
    "Qwen/Qwen3-0.6B": 596_049_920,
    "Qwen/Qwen3-8B": 8.19e9,
    "Qwen/Qwen3-32B": 32.8e9,
    "mistralai/Mistral-7B-v0.3": 7.25e9,
    "mistralai/Mistral-Nemo-Base-2407": 12.2e9,
    "google/gemma-2-2b": 2.61e9,
    "google/gemma-2-9b": 9.24e9,
    "google/gemma-2-27b": 27.2e9,
    "google/gemma-3-1b-pt": 999_885_952,
    "google/gemma-3-12b-pt": 11_765_788_416,  # language model only, as every count here
    "microsoft/Phi-3-mini-4k-instruct": 3_821_079_552,
    "microsoft/phi-4": 14.7e9,
}


@pytest.mark.parametrize("model_id", sorted(PUBLISHED))
def test_shipped_shapes_give_the_published_parameter_counts(model_id: str) -> None:
    shape = flops.model_shape(load_config(model_id).get_text_config())
    assert shape.total_params() == pytest.approx(PUBLISHED[model_id], rel=0.005)


def test_every_shipped_config_loads_and_is_a_few_kb() -> None:
    ids = shipped_ids()
    assert len(ids) >= 30 and "meta-llama/Llama-3.1-8B" in ids
    for model_id in ids:
        assert flops.model_shape(load_config(model_id).get_text_config()).total_params() > 4e8, model_id
    for f in (REPO / "trainer" / "plan" / "models").glob("*.json"):
        assert f.stat().st_size < 4096, f


def test_lookup_is_case_insensitive_and_knows_the_usual_variants() -> None:
    base = shipped_config("meta-llama/Llama-3.1-8B")
    assert base is not None and base["hidden_size"] == 4096
    for alias in (
        "META-LLAMA/llama-3.1-8b",
        "meta-llama/Meta-Llama-3.1-8B",
        "meta-llama/Llama-3.1-8B-Instruct",
        "Llama-3.1-8B",
    ):
        assert shipped_config(alias) == base, alias
    assert shipped_config("Qwen/Qwen2.5-7B-Instruct") == shipped_config("Qwen/Qwen2.5-7B")
    assert shipped_config("google/gemma-2-9b-it") == shipped_config("google/gemma-2-9b")
    # controls: another org's model of the same name, and an unknown size, are not guessed
    assert shipped_config("someone/Llama-3.1-8B") is None
    assert shipped_config("meta-llama/Llama-3.1-9B") is None


def test_model_id_or_recipe() -> None:
    assert looks_like_model_id("meta-llama/Llama-3.1-8B")
    assert not looks_like_model_id("recipes/tiny-cpu.yaml")
    assert not looks_like_model_id("recipes/gpu")  # an existing path
    assert not looks_like_model_id("train.max_steps=3")


def test_a_local_path_wins_over_the_shipped_table(tiny_llama: Path) -> None:
    assert load_config(str(tiny_llama)).hidden_size == 64  # the fixture model, not a shipped shape


class Ran(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


# Runs each command line (a JSON list of argument lists) through the CLI's main in turn, its output
# captured; prints [code, stdout, stderr] for each.
COMMANDS = """
import contextlib, io, json, sys
from trainer.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, out.getvalue(), err.getvalue()])
sys.stdout.write(json.dumps(results))
"""


@pytest.fixture(scope="module")
def offline(tiny_data: Path, tiny_llama: Path) -> dict[str, Ran]:
    """This module's `spotune` commands, one after another in one process started offline:
    HF_HUB_OFFLINE=1 and no HF_TOKEN, which the hub libraries read as they are imported. One
    process, not one each: each would pay the same 7 s of imports before its command."""
    commands = {
        "model id": ["estimate", "meta-llama/Llama-3.1-8B", "--json", "--gpu", "A100-80GB"],
        "gpu recipe": [
            "estimate",
            str(REPO / "recipes" / "gpu" / "llama-3.1-8b-qlora.yaml"),
            f"data.path={tiny_data}",  # our data
            f"data.tokenizer={tiny_llama}",
            "data.seq_len=512",
            "data.format=alpaca",
            "--json",
        ],
        "unknown id": ["estimate", "some-org/not-a-shipped-model"],
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("HF_TOKEN", None)
    done = subprocess.run(
        [sys.executable, "-c", COMMANDS, json.dumps(list(commands.values()))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: Ran(*ran) for name, ran in zip(commands, json.loads(done.stdout), strict=True)}


def test_estimate_accepts_a_model_id_offline(offline: dict[str, Ran]) -> None:
    out = offline["model id"]
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["model"]["name_or_path"] == "meta-llama/Llama-3.1-8B"
    assert result["model"]["params"] == pytest.approx(8.03e9, rel=0.005)


def test_estimate_of_a_gpu_recipe_works_offline(offline: dict[str, Ran]) -> None:
    out = offline["gpu recipe"]
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["model"]["name_or_path"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert result["model"]["params"] == pytest.approx(8.03e9, rel=0.005)


def test_an_unknown_id_offline_names_the_fix(offline: dict[str, Ran]) -> None:
    out = offline["unknown id"]
    assert out.returncode == 2
    assert "some-org/not-a-shipped-model" in out.stderr
    assert "local directory" in out.stderr and "HF_TOKEN" in out.stderr
    assert "recipe file not found" not in out.stderr
    with pytest.raises(PlanError, match="config.json"):
        load_config(str(REPO / "no-such-model-dir" / "x"))
