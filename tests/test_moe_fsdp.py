"""The engine's promises on a mixture-of-experts model: FSDP2 over two gloo ranks trains the expert LoRA (peft's
ParamWrapper on the fused 3-D expert parameters, spotune's per-token kernel) as one process does, its checkpoint
resumes on one process (2 ranks -> 1: the elastic contract), and packed rows train each document as it would
alone (routing is per token, attention per document)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_attention import DOCS, SEQ, _load, _micro, _register_blind, _spans
from test_fsdp import TOLERANCE, _adapter, _one_process, _overrides, _relative_gap, _rows, _step, _torchrun

from trainer.model import attention

ARCH = "qwen3_moe"  # the most tuned MoE family; its experts are fused [experts, 2 x inner, hidden]


@pytest.mark.slow
def test_fsdp_on_an_moe_trains_its_experts_as_one_process_and_resumes_on_one(
    tmp_path: Path, tiny_model: Callable[[str], Path], tiny_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """FSDP2 on 2 ranks -> one process against one uninterrupted process on a tiny Qwen3-MoE: the same rows, the
    same adapter (expert factors included) within fp32 summation order, the router aux loss the same."""
    model = tiny_model(ARCH)
    cache, ref, out = tmp_path / "cache", tmp_path / "reference", tmp_path / "moved"
    extra = {"adapter.target_modules": "all-linear"}
    _one_process(_overrides(model, tiny_data, cache, ref, 3, **extra))
    log = _torchrun(
        _overrides(model, tiny_data, cache, out, 2, **extra, **{"train.distributed": "fsdp"}), tmp_path / "fsdp.log"
    )
    assert "FSDP: sharding over 2 processes" in log
    experts = [k for k in _adapter(_step(ref, 2)) if ".experts." in k]
    assert experts  # the expert LoRA is in the checkpoint, as peft lays it out
    gap = _relative_gap(_adapter(_step(out, 2)), _adapter(_step(ref, 2)))
    control = _relative_gap(_adapter(_step(ref, 1)), _adapter(_step(ref, 2)))  # one step less: must fail
    moved = {k: _adapter(_step(out, 2))[k] - _adapter(_step(ref, 1))[k] for k in experts}
    assert any(float(d.abs().max()) > 0 for d in moved.values())  # the experts' factors moved under FSDP
    for step in (1, 2):
        a, b = _rows(out)[step], _rows(ref)[step]
        assert a["sample_digest"] == b["sample_digest"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"])
        assert abs(a["router_aux_loss"] - b["router_aux_loss"]) <= 1e-5 * abs(b["router_aux_loss"])
    capsys.readouterr()
    _one_process(_overrides(model, tiny_data, cache, out, 3, **extra))  # 2 ranks -> 1
    assert f"resuming from {_step(out, 2)}" in capsys.readouterr().err
    final = _relative_gap(_adapter(out / "final"), _adapter(ref / "final"))
    with capsys.disabled():
        print(
            f"\nMoE fsdp(2) vs one process at step 2: {gap:.3g}; -> 1 process at step 3: {final:.3g}; control {control:.3g}"
        )
    assert gap <= TOLERANCE < control and final <= TOLERANCE
    assert {s: r["sample_digest"] for s, r in _rows(out).items()} == {
        s: r["sample_digest"] for s, r in _rows(ref).items()
    }


@pytest.mark.parametrize("impl", [attention.VARLEN, "sdpa", "test_blind"])
def test_packed_documents_of_an_moe_train_as_each_alone(tiny_model: Callable[[str], Path], impl: str) -> None:
    """Packed rows of two documents each (position ids restart, the bounds passed as to FlashAttention) give each
    token of an MoE the logits it has alone: the experts a token routes to depend on that token alone, and the
    attention keeps the documents apart. Control (`test_blind`): attention across the whole row changes them."""
    path = tiny_model(ARCH)
    _register_blind()
    model, alone_model = _load(path, impl), _load(path, "sdpa")
    micro = _micro(model.config.vocab_size)
    with torch.no_grad():
        inputs, bounds = attention.model_inputs(micro, impl)
        packed = model(**inputs, **bounds, use_cache=False).logits.reshape(len(DOCS), SEQ, -1)
        apart = []
        for r, s, e in _spans():
            alone = alone_model(input_ids=micro["input_ids"][r : r + 1, s:e], use_cache=False).logits[0]
            apart.append(torch.allclose(packed[r, s:e], alone, rtol=1e-5, atol=1e-5))
    assert all(apart) if impl != "test_blind" else not all(apart), apart
