"""`train.deterministic`: the switches, what it refuses, and (on a GPU) bit-identical runs and resumes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from trainer import builtin_assets as tiny
from trainer import config as C
from trainer.restart.signals.preemption import STOP_AFTER_ENV
from trainer.training import determinism, run

pytestmark = pytest.mark.bitwise  # separate runs agree bit for bit: one intra-op thread (conftest.py)


def test_the_switches_are_on_inside_and_put_back_after(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    with determinism.kernels(True) as notes:
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # an op without one raises
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == determinism.CUBLAS_WORKSPACE
        assert os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "1"
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert any("deterministic mode" in n for n in notes)
    assert torch.are_deterministic_algorithms_enabled() == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and "FLASH_ATTENTION_DETERMINISTIC" not in os.environ
    with determinism.kernels(False) as notes:  # control: off changes nothing
        assert notes == [] and torch.are_deterministic_algorithms_enabled() == before


def test_compile_is_refused_with_the_reason() -> None:
    with pytest.raises(C.ConfigError, match="model.compile=true cannot be deterministic .* set model.compile=false"):
        C.load(None, ["train.deterministic=true", "model.compile=true"])
    C.load(None, ["train.deterministic=true"])
    C.load(None, ["model.compile=true"])


def _cfg(tmp_path: Path, name: str, model: Path, data: Path, device_extra: dict[str, Any], **train: Any) -> C.RunConfig:
    return C.from_dict(
        {
            "output_dir": str(tmp_path / name),
            "seed": 11,
            "model": {"name_or_path": str(model), **device_extra.get("model", {})},
            "adapter": {"r": 8, "alpha": 16, "dropout": 0.1},
            "data": {"path": str(data), "seq_len": device_extra.get("seq_len", 128), "cache_dir": str(tmp_path / "c")},
            "train": {"max_steps": 6, "micro_batch_size": 2, "grad_accum": 2, "lr": 3e-3, **train},
            "checkpoint": {"every_steps": 3, "every_minutes": None},
            "metrics": {"progress": False, "report": False},
        }
    )


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "adapter_model.safetensors")


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cpu_training_in_deterministic_mode_is_the_same_bits(tmp_path: Path, tiny_llama: Path, tiny_data: Path) -> None:
    """On CPU fp32 the run is deterministic already: the mode runs every op of the path (none lacks
    a deterministic variant) and changes no bit."""
    cpu = {"model": {"dtype": "float32"}}
    assert run.train(_cfg(tmp_path, "plain", tiny_llama, tiny_data, cpu)) == 0
    assert run.train(_cfg(tmp_path, "det", tiny_llama, tiny_data, cpu, deterministic=True)) == 0
    assert _identical(_adapter(tmp_path / "plain"), _adapter(tmp_path / "det"))
    assert not torch.are_deterministic_algorithms_enabled()  # put back for the tests after this one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_runs_and_resumes_are_bit_identical(tmp_path: Path, tiny_tokenizer: Path, monkeypatch) -> None:
    """bf16 on the GPU, a model large enough for atomics to matter: two uninterrupted runs and a
    run stopped at step 3 and resumed end with the same bits. Control: one step fewer differs."""
    model = tiny.build_model(
        tmp_path / "m", "llama", tokenizer_dir=tiny_tokenizer, hidden=512, layers=4, heads=8, kv_heads=2
    )
    data = tiny.write_dataset(tmp_path / "d.jsonl", n=400)
    gpu = {"model": {"dtype": "bfloat16"}, "seq_len": 1024}
    bf16 = {"deterministic": True, "mixed_precision": "bf16"}
    assert run.train(_cfg(tmp_path, "a", model, data, gpu, **bf16)) == 0
    assert run.train(_cfg(tmp_path, "b", model, data, gpu, **bf16)) == 0
    monkeypatch.setenv(STOP_AFTER_ENV, "3")
    assert run.train(_cfg(tmp_path, "r", model, data, gpu, **bf16)) == 143
    monkeypatch.delenv(STOP_AFTER_ENV)
    assert run.train(_cfg(tmp_path, "r", model, data, gpu, **bf16)) == 0
    a, b, resumed = (_adapter(tmp_path / n) for n in ("a", "b", "r"))
    assert _identical(a, b), "two deterministic runs differ"
    assert _identical(a, resumed), "the resumed run differs from the uninterrupted one"
    assert run.train(_cfg(tmp_path, "short", model, data, gpu, **{**bf16, "max_steps": 5})) == 0
    assert not _identical(a, _adapter(tmp_path / "short"))  # control: the comparison sees one step


def test_a_bitwise_module_trains_with_one_intra_op_thread() -> None:
    """conftest.py pins this module (and every process it starts) to one intra-op thread."""
    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"
