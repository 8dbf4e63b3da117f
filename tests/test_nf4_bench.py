"""benchmarks/nf4_matmul.py times the same maths on every path: bitsandbytes' 4-bit matmul (what
peft's Linear4bit runs), its dequantise + F.linear fallback and torchao's NF4 each compute a
matmul with their own dequantised NF4 weight, forward and input gradient, and torchao's NF4 agrees
with bitsandbytes' within NF4's rounding; an FP4 weight in bitsandbytes' place is caught. The CLI
runs on CPU without CUDA, says its figures are CPU figures, and exits 0."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("bitsandbytes", reason="bitsandbytes (a core dependency) is not installed")
pytest.importorskip("torchao", reason="torchao (the `bench` extra) is not installed: pip install torchao --no-deps")


@functools.cache
def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nf4_matmul", REPO / "benchmarks" / "nf4_matmul.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["nf4_matmul"] = module
    spec.loader.exec_module(module)
    return module


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    weight = (torch.randn(128, 256) * 0.02).to(dtype)
    return weight, torch.randn(32, 256).to(dtype), torch.randn(32, 128).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_is_a_matmul_with_the_same_nf4_weight(dtype: torch.dtype) -> None:
    bench = _bench()
    weight, x, g = _inputs(dtype)
    paths = bench.build_paths(weight, compiled=False)
    assert {k for k, v in paths.items() if not isinstance(v, str)} == {
        "bf16_dense",
        "bnb_matmul_4bit",
        "bnb_dequant_linear",
        "torchao_nf4",
    }
    found = bench.check_paths(paths, x, g)
    exact = 1e-6 if dtype == torch.float32 else bench.SELF_TOL
    for name in ("bf16_dense", "bnb_matmul_4bit", "bnb_dequant_linear", "torchao_nf4"):
        assert max(found[name].values()) <= exact, (name, found[name])
    # Two NF4 roundings of one weight: close, but not the same numbers (their block scales differ).
    cross = found["torchao_vs_bnb"]
    assert 1e-4 < max(cross.values()) <= bench.CROSS_TOL, cross
    # ...and both far closer to each other than NF4 is to the weight it quantised.
    nf4_error = bench._rel(paths["bnb_matmul_4bit"][1], weight)
    assert 0.05 < nf4_error and max(cross.values()) < nf4_error / 2


def test_the_check_catches_a_path_that_quantises_differently() -> None:
    """Control: bitsandbytes' side quantised as FP4 (same layout, same calls, other maths) is
    still a matmul with its own weight, but the cross check against torchao's NF4 fails."""
    bench = _bench()
    weight, x, g = _inputs(torch.float32)
    paths = bench.build_paths(weight, compiled=False, quant_type="fp4")
    with pytest.raises(AssertionError, match="torchao's NF4 and bitsandbytes' 4-bit path disagree"):
        bench.check_paths(paths, x, g)


def test_the_check_catches_a_path_that_is_not_its_own_weight() -> None:
    """Control: a path whose forward uses another weight than the one it reports is named."""
    bench = _bench()
    weight, x, g = _inputs(torch.float32)
    paths = bench.build_paths(weight, compiled=False)
    fn, own = paths["torchao_nf4"]
    paths["torchao_nf4"] = (fn, own.flip(0))
    with pytest.raises(AssertionError, match="torchao_nf4 is not a matmul with its own dequantised weight"):
        bench.check_paths(paths, x, g)


def test_cpu_run_says_so_and_writes_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    bench = _bench()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path even on a GPU runner
    out = tmp_path / "nf4.json"
    result = bench.main(["--json", str(out), "--tokens", "32", "--warmup", "1", "--iters", "2"])
    assert json.loads(out.read_text()) == result
    assert result["device"] == "cpu" and "CPU FIGURES" in capsys.readouterr().out
    (shape,) = result["shapes"]
    (row,) = shape["rows"]
    assert row["tokens"] == 32 and row["bnb_matmul_4bit"]["ratio_to_bnb"] == 1.0
    for name in ("bf16_dense", "bnb_dequant_linear", "torchao_nf4"):
        assert row[name]["ms"] > 0 and row[name]["ratio_to_bnb"] > 0
    assert row["torchao_nf4_compiled"].startswith("skipped: ")
