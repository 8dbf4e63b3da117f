"""benchmarks/nf4_matmul.py times the same maths on every path: bitsandbytes' 4-bit matmul (what
peft's Linear4bit runs), its dequantise + F.linear fallback and torchao's NF4 each compute a
matmul with their own dequantised NF4 weight, forward and input gradient, and torchao's NF4 agrees
with bitsandbytes' within NF4's rounding; a path given the wrong weight, and an FP4 weight in
bitsandbytes' place, are caught. The CLI runs on CPU without CUDA, says its figures are CPU
figures, and exits 0.

torchao is in no extra (transformers imports it on every `import peft` once it is installed:
slower start-up and warnings in every run), so its tests skip where it is absent; run them with
`pip install --no-deps --target DIR torchao` and DIR on PYTHONPATH."""

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
BNB_PATHS = ("bf16_dense", "bnb_matmul_4bit", "bnb_dequant_linear")
# Asked of the installed packages, not imported at collection (~2 s per test worker, with TorchInductor).
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes (a core dependency) is not installed"
)


def _torchao() -> None:
    pytest.importorskip("torchao", reason="torchao is not installed (kept out of the extras; see this module's doc)")


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


def _timed(paths: dict) -> set[str]:
    return {k for k, v in paths.items() if not isinstance(v, str)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitsandbytes_paths_are_matmuls_with_their_nf4_weight(dtype: torch.dtype) -> None:
    bench = _bench()
    weight, x, g = _inputs(dtype)
    paths = bench.build_paths(weight, compiled=False)
    assert tuple(paths) == bench.PATHS  # every path the CLI and the docs name, skipped or not
    assert _timed(paths) >= set(BNB_PATHS)
    found = bench.check_paths({k: paths[k] for k in BNB_PATHS}, x, g)
    exact = 1e-6 if dtype == torch.float32 else bench.SELF_TOL
    for name in BNB_PATHS:
        assert max(found[name].values()) <= exact, (name, found[name])
    # The 4-bit paths really are NF4 of the weight: about 9% off it, not the weight itself.
    assert 0.05 < bench._rel(paths["bnb_matmul_4bit"][1], weight) < 0.15
    assert paths["bnb_matmul_4bit"][1] is paths["bnb_dequant_linear"][1]


def test_the_check_catches_a_path_that_is_not_its_own_weight() -> None:
    """Control: a path whose forward uses another weight than the one it reports is named."""
    bench = _bench()
    weight, x, g = _inputs(torch.float32)
    paths = bench.build_paths(weight, compiled=False)
    fn, own = paths["bnb_dequant_linear"]
    bad = {"bnb_dequant_linear": (fn, own.flip(0))}
    with pytest.raises(AssertionError, match="bnb_dequant_linear is not a matmul with its own dequantised weight"):
        bench.check_paths(bad, x, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchao_nf4_agrees_with_bitsandbytes_nf4(dtype: torch.dtype) -> None:
    _torchao()
    bench = _bench()
    weight, x, g = _inputs(dtype)
    paths = bench.build_paths(weight, compiled=False)
    assert _timed(paths) == {*BNB_PATHS, "torchao_nf4"}
    found = bench.check_paths(paths, x, g)
    assert max(found["torchao_nf4"].values()) <= (1e-6 if dtype == torch.float32 else bench.SELF_TOL)
    # Two NF4 roundings of one weight: close, but not the same numbers (their block scales differ),
    # and far closer to each other than NF4 is to the weight it quantised.
    cross = max(found["torchao_vs_bnb"].values())
    nf4_error = bench._rel(paths["bnb_matmul_4bit"][1], weight)
    assert 1e-4 < cross <= bench.CROSS_TOL and cross < nf4_error / 2, (cross, nf4_error)


def test_the_check_catches_a_path_that_quantises_differently() -> None:
    """Control: bitsandbytes' side quantised as FP4 (same layout, same calls, other maths) is
    still a matmul with its own weight, but the cross check against torchao's NF4 fails."""
    _torchao()
    bench = _bench()
    weight, x, g = _inputs(torch.float32)
    paths = bench.build_paths(weight, compiled=False, quant_type="fp4")
    with pytest.raises(AssertionError, match="torchao's NF4 and bitsandbytes' 4-bit path disagree"):
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
    for name in ("bf16_dense", "bnb_dequant_linear"):
        assert row[name]["ms"] > 0 and row[name]["ratio_to_bnb"] > 0
    eager = row["torchao_nf4"]
    assert eager["ms"] > 0 if isinstance(eager, dict) else eager.startswith("skipped: torchao not importable")
    assert row["torchao_nf4_compiled"].startswith("skipped: ")


def test_the_invoke_quant_dequantisation_is_torchaos_bit_for_bit() -> None:
    """The fused path's dequantisation is torchao's, written out in plain ops: bit-exact, so the
    fused path times the same weight as torchao's own (a layout change in torchao fails here)."""
    _torchao()
    bench = _bench()
    to_nf4, _ = bench._torchao_nf4()
    for dtype in (torch.float32, torch.bfloat16):
        weight, _, _ = _inputs(dtype)
        nf4 = to_nf4(weight, 64, 256)
        inner = (nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor, nf4.scaler_mean, nf4.nf4)
        written_out = bench.nf4_dequant(*inner).view(weight.shape)
        assert torch.equal(written_out, nf4.to(dtype))
        # Control: the two nibbles swapped is another weight.
        swapped = bench.nf4_dequant((inner[0] >> 4) | (inner[0] << 4), *inner[1:]).view(weight.shape)
        assert not torch.equal(swapped, nf4.to(dtype))


def test_a_path_that_raises_is_recorded_and_the_others_still_checked() -> None:
    bench = _bench()
    weight, x, g = _inputs(torch.float32)
    paths = bench.build_paths(weight, compiled=False)

    def broken(t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("Triton could not compile this")

    checked = {k: paths[k] for k in BNB_PATHS} | {"broken": (broken, weight)}
    failed: dict[str, str] = {}
    found = bench.check_paths(checked, x, g, failed=failed)
    assert failed == {"broken": "failed: RuntimeError: Triton could not compile this"}
    assert set(found) == set(BNB_PATHS)
    with pytest.raises(RuntimeError, match="Triton could not compile this"):  # without `failed`: raised
        bench.check_paths(checked, x, g)


def test_the_bnb_invoke_quant_dequantisation_is_bitsandbytes_bit_for_bit() -> None:
    """The marked path on bitsandbytes' storage dequantises exactly as dequantize_4bit does."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    bench = _bench()
    weight, _, _ = _inputs(torch.bfloat16)
    packed, state = quantize_4bit(weight, quant_type="nf4", blocksize=64, compress_statistics=True)
    inner = (packed, state.absmax, state.state2.code, state.state2.absmax, state.offset, state.code)
    assert torch.equal(bench.bnb_nf4_dequant(*inner).view(weight.shape), dequantize_4bit(packed, state))
    # Control: each 64-value block scaled by its neighbour's scale is another weight.
    shifted = (inner[0], inner[1].roll(1), *inner[2:])
    assert not torch.equal(bench.bnb_nf4_dequant(*shifted).view(weight.shape), dequantize_4bit(packed, state))


def test_the_marked_path_traces_forward_and_backward_on_cpu() -> None:
    """InvokeQuant is a private torch API: the marked path still traces through dynamo and
    AOTAutograd and computes the same matmul and input gradient on this torch. aot_eager, not
    Inductor: Inductor's CPU code generation would add ~15 s here and says nothing of the GPU's
    fusion (run by hand on CPU with Inductor and max-autotune, it passes the same check)."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    bench = _bench()
    weight, x, g = _inputs(torch.bfloat16)
    packed, state = quantize_4bit(weight, quant_type="nf4", blocksize=64, compress_statistics=True)
    inner = (packed, state.absmax, state.state2.code, state.state2.absmax, state.offset, state.code)
    fused = bench.invoke_quant_path(bench.bnb_nf4_dequant, inner, tuple(state.shape), backend="aot_eager")
    if isinstance(fused, str):
        pytest.skip(fused)
    own = dequantize_4bit(packed, state)
    found = bench.check_paths({"marked": (fused, own)}, x, g)
    assert max(found["marked"].values()) <= bench.SELF_TOL
    with pytest.raises(AssertionError, match="control is not a matmul"):  # the same graph, another weight
        bench.check_paths({"control": (fused, own.flip(1))}, x, g)
