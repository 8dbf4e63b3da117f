"""Packed documents stay apart under every attention implementation, for micro-batches of B >= 2.

The varlen path is checked through an attention function registered with transformers'
`AttentionInterface` (spotune_varlen; on CPU its per-document reference kernel), the same way
FlashAttention receives the bounds: one row of B*S tokens plus cu_seq_lens/max_length.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from trainer.data.template import IGNORE_INDEX
from trainer.model import attention
from trainer.model import loss as micro_loss
from trainer.training import batches as step_data

# Two rows of 20 tokens: row 0 holds documents of 9 and 7 tokens and 4 of padding, row 1 of 12 and 8.
DOCS = [[9, 7, 4], [12, 8]]
SEQ = 20


def _micro(vocab: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (len(DOCS), SEQ), generator=g)
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in DOCS])
    labels = ids.clone()
    labels[pos == 0] = IGNORE_INDEX  # a document's first token is never predicted
    labels[0, 16:] = IGNORE_INDEX  # padding
    return step_data.micro_batch(ids, labels, pos)


def _spans() -> list[tuple[int, int, int]]:
    """(row, start, end) of every real document."""
    out = []
    for r, row in enumerate(DOCS):
        start = 0
        for n in row[:2]:
            out.append((r, start, start + n))
            start += n
    return out


def _load(path: Path, impl: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if impl == attention.VARLEN:
        attention.register()
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=torch.float32).eval()


def _blind(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, **kw: Any) -> Any:
    """Control kernel: causal attention over the whole row, ignoring the document bounds."""
    if q.size(1) != k.size(1):
        k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=kw.get("scaling")).transpose(1, 2), None


def _register_blind() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("test_blind", _blind)
    AttentionMaskInterface.register("test_blind", lambda *a, **k: None)


def test_micro_batch_bounds_and_label_index() -> None:
    micro = _micro(100)
    assert micro["cu_seq_lens"].tolist() == [0, 9, 16, 20, 32, 40]
    assert micro["cu_seq_lens"].dtype == torch.int32 and micro["max_length"] == 12
    flat_labels = micro["labels"].reshape(-1)
    assert torch.equal(flat_labels[micro["label_index"] + 1], micro["label_targets"])
    assert len(micro["label_index"]) == step_data.count_trainable(micro["labels"])


@pytest.mark.parametrize("impl", [attention.VARLEN, "sdpa", "eager"])
def test_packed_rows_equal_documents_alone(tiny_llama: Path, impl: str) -> None:
    model = _load(tiny_llama, impl)
    alone_model = _load(tiny_llama, "sdpa")
    micro = _micro(model.config.vocab_size)
    with torch.no_grad():
        inputs, bounds = attention.model_inputs(micro, impl)
        packed = model(**inputs, **bounds, use_cache=False).logits
        packed = packed.reshape(len(DOCS), SEQ, -1)
        for r, s, e in _spans():
            alone = alone_model(input_ids=micro["input_ids"][r : r + 1, s:e], use_cache=False).logits[0]
            torch.testing.assert_close(packed[r, s:e], alone, rtol=1e-5, atol=1e-5)


def test_control_without_bounds_attends_across_documents(tiny_llama: Path) -> None:
    _register_blind()
    blind = _load(tiny_llama, "test_blind")
    alone_model = _load(tiny_llama, "sdpa")
    micro = _micro(blind.config.vocab_size)
    with torch.no_grad():
        inputs, bounds = attention.model_inputs(micro, "test_blind")
        packed = blind(**inputs, **bounds, use_cache=False).logits.reshape(2, SEQ, -1)
        r, s, e = _spans()[1]  # the second document of row 0 sees the first one without bounds
        alone = alone_model(input_ids=micro["input_ids"][r : r + 1, s:e], use_cache=False).logits[0]
    assert not torch.allclose(packed[r, s:e], alone, atol=1e-3)


def test_varlen_refuses_to_run_without_bounds(tiny_llama: Path) -> None:
    model = _load(tiny_llama, attention.VARLEN)
    micro = _micro(model.config.vocab_size)
    with pytest.raises(ValueError, match="needs one packed row with cu_seq_lens_q"):
        model(input_ids=micro["input_ids"], position_ids=micro["position_ids"], use_cache=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2", "qwen3", "phi3", "gemma3"])
def test_loss_is_the_same_under_every_implementation(tiny_model: Callable[..., Path], arch: str) -> None:
    """token_loss_sum (our head and loss, bounds per implementation) equals the plain per-document
    computation with the model's own head, for each architecture's decoder body."""
    path = tiny_model(arch)
    reference = _load(path, "sdpa")
    micro = _micro(reference.config.vocab_size)
    with torch.no_grad():
        expected = torch.zeros(())
        for r, s, e in _spans():
            logits = reference(input_ids=micro["input_ids"][r : r + 1, s:e], use_cache=False).logits[0, :-1]
            expected += F.cross_entropy(logits, micro["labels"][r, s + 1 : e], reduction="sum")
        for impl in ("sdpa", attention.VARLEN):
            got = micro_loss.token_loss_sum(_load(path, impl), micro)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        blind = {**micro, "position_ids": torch.arange(SEQ).expand(2, SEQ)}  # control: no bounds for sdpa
        assert abs(float(micro_loss.token_loss_sum(reference, blind)) - float(expected)) > 1e-3
