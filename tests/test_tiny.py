"""Built-in offline assets: deterministic, loadable with the real transformers code, any text encodes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer import builtin_assets
from trainer.config import BUILTIN_TINY_DATA, BUILTIN_TINY_MODEL


def test_tokenizer_round_trips_any_text(tiny_tokenizer: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    text = "Ünïcode ✓ and 数字 42 — not in the training corpus"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_every_arch_loads_and_runs(tiny_model: Callable[..., Path], arch: str) -> None:
    path = tiny_model(arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch
    tok = AutoTokenizer.from_pretrained(path)
    out = model(input_ids=torch.tensor([tok("Add the two numbers.").input_ids]))
    assert out.logits.shape[-1] == len(tok)


def test_model_build_is_deterministic(tmp_path: Path, tiny_tokenizer: Path) -> None:
    a = load_file(
        builtin_assets.build_model(tmp_path / "a", tokenizer_dir=tiny_tokenizer, seed=3) / "model.safetensors"
    )
    b = load_file(
        builtin_assets.build_model(tmp_path / "b", tokenizer_dir=tiny_tokenizer, seed=3) / "model.safetensors"
    )
    c = load_file(
        builtin_assets.build_model(tmp_path / "c", tokenizer_dir=tiny_tokenizer, seed=4) / "model.safetensors"
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # control: the seed matters


def test_builtin_names_resolve_to_real_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPOTUNE_HOME", str(tmp_path))
    model_dir = Path(builtin_assets.resolve_model(BUILTIN_TINY_MODEL))
    assert (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists()
    assert builtin_assets.resolve_model(BUILTIN_TINY_MODEL) == str(model_dir)  # built once, then reused
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no leftovers
    assert builtin_assets.resolve_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    rows = [json.loads(line) for line in Path(builtin_assets.resolve_data(BUILTIN_TINY_DATA)).read_text().splitlines()]
    assert len(rows) == 2000 and set(rows[0]) == {"instruction", "input", "output"}


def test_synthetic_answers_are_correct() -> None:
    rows = builtin_assets.make_examples(600, seed=7)
    assert rows == builtin_assets.make_examples(600, seed=7)
    assert rows != builtin_assets.make_examples(600, seed=8)  # control: the seed matters
    capitals = [r for r in rows if "capital" in r["instruction"]]
    assert capitals and all(r["output"] == builtin_assets._CAPITALS[r["input"]] for r in capitals)
    days = [r for r in rows if "after" in r["instruction"] or "follows" in r["instruction"]]
    assert days and all(
        builtin_assets._DAYS[(builtin_assets._DAYS.index(r["input"]) + 1) % 7] == r["output"] for r in days
    )
    plans = [r for r in rows if r["instruction"].startswith("Plan ")]
    assert plans
    for r in plans:
        n, start = int(r["instruction"].split()[1]), r["instruction"].split()[-1].rstrip(".")
        sentences = r["output"].removesuffix(".").split(". ")
        assert len(sentences) == n and sentences[0] == f"Day 1 is {start}"


def test_held_out_questions_are_never_trained_on() -> None:
    """Held-out prompts belong to the task family (each key is trained in other phrasings) but never
    appear in the built-in data; a question that is trained on is found (the check can fail)."""
    held = {(h["instruction"], h["input"]) for h in builtin_assets.held_out_examples()}
    assert len(held) == 8
    rows = builtin_assets.make_examples()
    trained = {(r["instruction"], r["input"]) for r in rows}
    assert not trained & held
    assert {k for _, k in held} <= {r["input"] for r in rows}  # every held-out key is trained in other phrasings
    assert ("What is the capital of this country?", "France") in trained  # control: the check can see a hit
