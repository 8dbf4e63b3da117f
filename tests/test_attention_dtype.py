"""`spotune_varlen` on CUDA with a float32 query: the choice is explicit (the flash kernel in a half
dtype, said once), not a silent per-document Python loop. The decision is a pure function, so it
runs here on CPU; the dispatch is exercised with a stand-in kernel of the 2.12+ signature."""

from __future__ import annotations

import pytest
import torch
from test_attention_kernels import _qkv, varlen_2_12

from trainer.model import attention


def test_the_choice_for_each_device_and_dtype() -> None:
    path, cast = attention.varlen_choice("cuda", torch.float32, kernel=True)
    assert path == "kernel" and cast in (torch.bfloat16, torch.float16)
    assert attention.varlen_choice("cuda", torch.bfloat16, kernel=True) == ("kernel", None)
    assert attention.varlen_choice("cuda", torch.float16, kernel=True) == ("kernel", None)
    assert attention.varlen_choice("cpu", torch.float32, kernel=True) == ("reference", None)
    path, cast = attention.varlen_choice("cuda", torch.float32, kernel=False)
    assert path.startswith("reference (") and cast is None
    path, _ = attention.varlen_choice("cuda", torch.float64, kernel=True)
    assert path == "reference (no flash kernel for torch.float64)"


def test_a_float32_query_runs_the_kernel_cast_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[torch.dtype] = []

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
               num_splits=None):  # fmt: skip  # torch 2.12's signature, computing in float32
        seen.append(query.dtype)
        out = varlen_2_12(query.float(), key.float(), value.float(), cu_seq_q, cu_seq_k, max_q, max_k,
                          scale=scale, window_size=window_size, enable_gqa=enable_gqa)  # fmt: skip
        return out.to(query.dtype)

    real = attention.varlen_choice
    monkeypatch.setattr(attention, "_installed_varlen", lambda: attention.VarlenKernel.of(kernel))
    monkeypatch.setattr(attention, "varlen_choice", lambda device, dtype, k: real("cuda", dtype, k))  # as on CUDA
    attention._say_once.cache_clear()
    q, k, v, cu = _qkv(torch.float32)
    module = torch.nn.Module().eval()
    args = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, H, T, D]
    out, _ = attention.varlen_attention(module, *args, None, cu_seq_lens_q=cu, max_length_q=int(cu.diff().max()))
    attention.varlen_attention(module, *args, None, cu_seq_lens_q=cu, max_length_q=int(cu.diff().max()))
    assert seen and all(d in (torch.bfloat16, torch.float16) for d in seen)
    assert out.dtype == torch.float32
    reference = attention.reference_varlen(q, k, v, cu, None).unsqueeze(0)
    torch.testing.assert_close(out, reference, atol=2e-2, rtol=2e-2)  # half-precision inputs
    assert capsys.readouterr().err.count("runs the flash kernel in") == 1
