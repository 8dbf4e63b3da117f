"""`spotune chat` on a mixture-of-experts run: the run directory resolves to its adapter, a reply streams, and the
model chat serves (peft's own loading of the expert adapter) gives the logits the training kernel gives."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from test_resume import _cfg

from trainer import builtin_assets
from trainer.config import AdapterConfig, ModelConfig
from trainer.model import load
from trainer.serve.chat import Chat, Conversation, Sampling, find_source
from trainer.training import run


def test_chat_serves_an_moe_run_as_it_trained(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    model_dir = tiny_model("qwen3_moe")
    data = builtin_assets.write_dataset(tmp_path / "train.jsonl", n=16)
    cfg = _cfg(tmp_path / "run", model_dir, data, tmp_path / "cache", 2, **{"adapter.target_modules": "all-linear"})
    assert run.train(cfg) == 0
    session = Chat(find_source(tmp_path / "run"), "cpu")
    pieces: list[str] = []
    reply = session.reply(
        Conversation(), "Name a color.", Sampling(max_new_tokens=8, temperature=0.0, min_new_tokens=4), pieces.append
    )
    assert reply and "".join(pieces) == reply
    # The training side: spotune's expert kernel with the saved adapter.
    trained = load.build(
        ModelConfig(name_or_path=str(model_dir), dtype="float32"), AdapterConfig(r=4, alpha=8, dropout=0.0)
    ).eval()
    ids = torch.randint(4, 200, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fresh = trained(input_ids=ids).logits  # control: the adapter at its start (B = 0), before loading
        from peft.utils import set_peft_model_state_dict

        set_peft_model_state_dict(trained, load_file(tmp_path / "run" / "final" / "adapter_model.safetensors"))
        want = trained(input_ids=ids).logits
        served = session.model(input_ids=ids).logits
    assert any("experts" in k for k in load_file(tmp_path / "run" / "final" / "adapter_model.safetensors"))
    torch.testing.assert_close(served, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(served, fresh, rtol=1e-5, atol=1e-5)
