"""trainer/training/autofit.py: `auto` micro-batch / checkpointing / offloading, chosen from the estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from trainer import config
from trainer.config import ConfigError, batch_split
from trainer.model import flops
from trainer.plan.memory import GIB
from trainer.training import autofit

REPO = Path(__file__).resolve().parents[1]


def _shape() -> flops.ModelShape:
    return flops.model_shape(
        transformers.LlamaConfig.from_pretrained(REPO / "benchmarks" / "configs" / "llama-3.1-8b.json")
    )


def _cfg(**dotted: object) -> config.RunConfig:
    base = {
        "model.name_or_path": "llama-8b",
        "model.gradient_checkpointing": "auto",
        "model.activation_offload": "auto",
        "train.micro_batch_size": "auto",
        "train.global_batch_size": 16,
        "data.seq_len": 4096,
        "adapter.dropout": 0.0,
    }
    return config.RunConfig().replace(**(base | dotted))


def test_candidates_run_fastest_first() -> None:
    order = autofit.candidates("auto", "auto", "auto", rows_per_device=4)
    assert [s.describe() for s in order[:3]] == [
        "micro_batch_size=4, gradient_checkpointing=false, activation_offload=off",
        "micro_batch_size=2, gradient_checkpointing=false, activation_offload=off",
        "micro_batch_size=1, gradient_checkpointing=false, activation_offload=off",
    ]
    assert not any(s.activation_offload and not s.gradient_checkpointing for s in order)
    assert order[-1] == autofit.Setting(1, True, True)
    assert autofit.candidates(3, True, "off", rows_per_device=12) == [autofit.Setting(3, True, False)]
    # Micro-batches split the rows per device evenly: 6 rows -> 6, 3, 2, 1.
    assert [s.micro_batch_size for s in autofit.candidates("auto", False, "off", 6)] == [6, 3, 2, 1]


@pytest.mark.parametrize(
    "method, free_gib, expected",
    [
        ("lora", 80, autofit.Setting(2, False, False)),  # 8B LoRA at 4096: 15 GiB of weights + ~25 GiB a row
        ("lora", 200, autofit.Setting(4, False, False)),
        ("lora", 40, autofit.Setting(8, True, False)),  # even one row needs recomputation here
        ("qlora", 24, autofit.Setting(4, True, False)),
        ("qlora", 8, autofit.Setting(1, True, True)),  # only with the layer inputs on the host
    ],
)
def test_the_fastest_setting_that_fits_is_chosen(method: str, free_gib: float, expected: autofit.Setting) -> None:
    cfg = _cfg(**{"adapter.method": method})
    resolved, lines = autofit.resolve(cfg, _shape(), free_gib * GIB, free_gib * GIB, world=1)
    got = autofit.Setting(
        resolved.train.micro_batch_size,
        resolved.model.gradient_checkpointing,
        resolved.model.activation_offload == "on",
    )
    assert got == expected, lines
    assert "estimated" in lines[0] and "GiB free" in lines[0]
    # The run is the recipe's: the global batch is what it says, accumulation absorbs the choice.
    split = batch_split(resolved.train, 1)
    assert split.global_rows == 16 and split.micro_steps * split.micro_batch_size == 16
    assert ("activation offloading on" in " ".join(lines)) == expected.activation_offload
    # Control: the next faster setting does not fit the same budget.
    order = autofit.candidates("auto", "auto", "auto", 16)
    i = order.index(expected)
    if i > 0:
        faster = autofit.choose(
            order[i - 1 : i], lambda s: autofit.estimate(cfg, _shape(), s), free_gib * GIB, free_gib * GIB
        )
        assert not faster.fits


def test_nothing_fits_says_so_with_figures_and_the_fix() -> None:
    resolved, lines = autofit.resolve(_cfg(), _shape(), 4 * GIB, 4 * GIB, world=1)
    assert "nothing fits" in lines[0] and "GiB" in lines[0] and "adapter.method=qlora" in lines[0]
    assert resolved.train.micro_batch_size == 1 and resolved.model.gradient_checkpointing is True


def test_explicit_settings_are_left_alone_and_offloading_is_logged() -> None:
    cfg = config.RunConfig().replace(**{"model.activation_offload": "on", "model.gradient_checkpointing": True})
    same, lines = autofit.resolve(cfg, _shape(), 80 * GIB, 80 * GIB, world=1)
    assert same is cfg and lines == [autofit.OFFLOAD_ON]
    plain = config.RunConfig()
    assert autofit.resolve(plain, _shape(), 80 * GIB, 80 * GIB, world=1) == (plain, [])


def test_auto_micro_batch_needs_the_global_batch() -> None:
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        config.RunConfig().replace(**{"train.micro_batch_size": "auto"})
    with pytest.raises(ConfigError, match="resolved first"):
        batch_split(_cfg().train, 1)
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        config.RunConfig().replace(**{"model.gradient_checkpointing": "sometimes"})


def test_a_run_with_auto_settings_logs_its_choice_and_keeps_the_global_batch(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainer.training import run

    out = tmp_path / "auto"
    cfg = config.RunConfig().replace(
        **{
            "output_dir": str(out),
            "model.name_or_path": str(tiny_llama),
            "model.dtype": "float32",
            "model.gradient_checkpointing": "auto",
            "model.activation_offload": "auto",
            "data.path": str(tiny_data),
            "data.seq_len": 128,
            "train.micro_batch_size": "auto",
            "train.global_batch_size": 4,
            "train.max_steps": 2,
            "metrics.progress": False,
            "metrics.report": False,
            "checkpoint.every_minutes": None,
        }
    )
    assert run.train(cfg) == 0
    said = capsys.readouterr()
    text = said.out + said.err
    # A tiny model in host memory: the fastest setting, four rows at once, no recomputation.
    assert "auto memory settings: micro_batch_size=4, gradient_checkpointing=false, activation_offload=off" in text
    assert "global batch stays 4 rows" in text
    state = json.loads(sorted((out / "checkpoints").glob("step-*"))[-1].joinpath("trainer_state.json").read_text())
    assert state["structural"]["global_batch_rows"] == 4
    written = config.load(out / "config.yaml")  # the recipe as written: a resume chooses again
    assert (written.train.micro_batch_size, written.model.gradient_checkpointing) == ("auto", "auto")


def test_estimate_takes_a_recipe_with_auto_settings(tiny_llama: Path, tiny_data: Path, tmp_path: Path) -> None:
    from trainer.cli import world as plan_cli
    from trainer.plan import table

    cfg = _cfg(
        **{
            "output_dir": str(tmp_path / "run"),
            "model.name_or_path": str(tiny_llama),
            "model.dtype": "float32",
            "data.path": str(tiny_data),
            "data.seq_len": 256,
            "metrics.progress": False,
            "metrics.report": False,
        }
    )
    doc = plan_cli.estimate_for_run(cfg, throughput=100.0)
    assert doc["run"]["global_batch_rows"] == 16  # the recipe's, whatever micro-batch a GPU gets
    assert doc["memory_gib"]["offloaded"] >= 0 and doc["memory_gib"]["total"] > 0
    assert "next_cheaper" in doc["recommendation"]
    assert "recommended: " in table.format_estimate(doc)
