"""Served as trained: a base model fine-tuned on a named template stops where training ended a turn.

The real Qwen2.5 and Llama 3.1 tokenizers (the shared data's tokenizers/) are made base-shaped: no
chat template, the base model's EOS (`<|endoftext|>`, `<|end_of_text|>`). A run on `chatml` / `llama3`
trains `<|im_end|>` / `<|eot_id|>` as the end of every turn; `final/`, the merged export and
`spotune chat` must stop there, while the base model's generation config (the control) runs on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SHARED_DATA
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor

from trainer import builtin_assets
from trainer import config as C
from trainer.serve.chat import Chat, find_source
from trainer.serve.export import export
from trainer.training import run

TOKENIZERS = SHARED_DATA / "tokenizers"
pytestmark = pytest.mark.skipif(not TOKENIZERS.is_dir(), reason=f"{TOKENIZERS} is absent (the shared data)")
# tokenizer folder, architecture, the base model's EOS, the named template, what it ends a turn with
FAMILIES = {
    "qwen2.5": ("qwen2.5-instruct", "qwen2", "<|endoftext|>", "chatml", "<|im_end|>"),
    "llama-3.1": ("llama-3.1-instruct", "llama", "<|end_of_text|>", "llama3", "<|eot_id|>"),
}


class _SayAt(LogitsProcessor):
    """Makes the model write `token` as its `at`-th new token (a random tiny model would not on its own)."""

    def __init__(self, prompt_len: int, at: int, token: int) -> None:
        self.where, self.token = prompt_len + at, token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] == self.where:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, self.token] = 0.0
        return scores


def _base_model(tmp: Path, folder: str, arch: Any, eos: str) -> Path:
    tok = AutoTokenizer.from_pretrained(TOKENIZERS / folder)
    tok.chat_template = None  # a base model ships no template
    tok.eos_token = eos
    tok.save_pretrained(tmp / "tokenizer")
    return builtin_assets.build_model(
        tmp / "base", arch, tokenizer_dir=tmp / "tokenizer", hidden=16, heads=2, kv_heads=1, layers=1
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_final_the_merged_model_and_chat_stop_on_the_trained_end_of_turn(tmp_path: Path, family: str) -> None:
    folder, arch, base_eos, template, end_of_turn = FAMILIES[family]
    base = _base_model(tmp_path, folder, arch, base_eos)
    rows = [{"instruction": f"Say {w}.", "input": "", "output": w} for w in ("hi", "yes", "no", "ok")]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = C.RunConfig().replace(
        **{
            "output_dir": str(tmp_path / "run"),
            "model.name_or_path": str(base),
            "model.dtype": "float32",
            "data.path": str(data),
            "data.seq_len": 64,
            "data.chat_template": template,
            "train.max_steps": 2,
            "adapter.r": 2,
            "metrics.progress": False,
            "metrics.report": False,
            "checkpoint.every_minutes": None,
        }
    )
    assert run.train(cfg) == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    stop, base_stop = tok.convert_tokens_to_ids(end_of_turn), tok.convert_tokens_to_ids(base_eos)
    base_config = GenerationConfig.from_pretrained(base)
    assert base_config.eos_token_id == base_stop  # base-shaped: the base model stops on its own EOS only
    merged = export(tmp_path / "run", tmp_path / "merged", merge=True)
    copied = export(tmp_path / "run", tmp_path / "adapter")
    served = {p: GenerationConfig.from_pretrained(p) for p in (tmp_path / "run" / "final", merged, copied)}
    for where, config in served.items():
        assert config.eos_token_id == [base_stop, stop], where  # the base's EOS, and the trained one
    assert Chat(find_source(tmp_path / "run"), "cpu").generation.eos_token_id == [base_stop, stop]

    model = AutoModelForCausalLM.from_pretrained(merged)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    n = prompt["input_ids"].shape[1]

    def reply(config: GenerationConfig) -> list[int]:
        say = _SayAt(n, 3, stop)
        out = model.generate(**prompt, generation_config=config, logits_processor=[say], max_new_tokens=12)
        return out[0, n:].tolist()

    config = served[merged]
    config.update(do_sample=False, max_new_tokens=None)
    answer = reply(config)
    assert len(answer) == 4 and answer[-1] == stop  # the turn ends where training ended turns
    base_config.update(do_sample=False)
    control = reply(base_config)
    assert control[3] == stop and len(control) == 12  # the base's config runs on past it into invented turns
