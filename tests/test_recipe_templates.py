"""No shipped recipe trains one format and ships another: the chat template its data is rendered with
is the one final/ (and a merged export) carries, both answered by chat_templates.resolve_chat_template."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import SHARED_DATA
from transformers import AutoTokenizer

from trainer import builtin_assets
from trainer import config as C
from trainer.data import formats
from trainer.data.chat_templates import own_template
from trainer.data.template import tokenize_for
from trainer.serve.final import save_tokenizer

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))
TOKENIZERS = SHARED_DATA / "tokenizers"
# A recipe's model -> the official tokenizer of its family in the shared data (same chat template).
FAMILIES = {
    "llama-3": "llama-3.1-instruct",
    "qwen3": "qwen3",
    "qwen2.5": "qwen2.5-instruct",
    "gemma-3": "gemma-3-it",
    "mistral": "mistral-7b-instruct-v0.3",
    "phi-4": "phi-4",
}

# Chat models whose official tokenizer (with its template) the shared data lacks: not a base model.
OWN_TEMPLATE_ELSEWHERE = ("gpt-oss",)


def _tokenizer_dir(name: str, tiny_llama: Path, bare: Path) -> Path:
    if name == C.BUILTIN_TINY_MODEL:
        return tiny_llama
    for key, folder in FAMILIES.items():
        if key in name.lower():
            if not TOKENIZERS.is_dir():
                pytest.skip(f"{TOKENIZERS} is absent (the shared data)")
            return TOKENIZERS / folder
    if any(key in name.lower() for key in OWN_TEMPLATE_ELSEWHERE):
        pytest.skip(f"{name}'s tokenizer ships its own chat template, and the shared data has no copy of it")
    return bare  # a model this test does not know: assume a base model whose tokenizer has no template


@pytest.fixture(scope="module")
def bare_tokenizer(tiny_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    tok.chat_template = None
    out = tmp_path_factory.mktemp("bare")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def loaded() -> Callable[[Path], Any]:
    """The tokenizer at a folder, loaded once for every recipe of its family (Gemma's takes 2 s of
    CPU). Only read: rendering (tokenize_for) and own_template change nothing on it."""
    return functools.cache(AutoTokenizer.from_pretrained)


@pytest.fixture(scope="module")
def shipped_template(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, str | None], str | None]:
    """The chat template final/ carries for a tokenizer folder and a `data.chat_template` setting:
    save_tokenizer (what write_final and export call) into a fresh folder, loaded back as a server
    would. Computed once per (folder, setting): save_tokenizer reads nothing else, and the five
    Llama-3 recipes (or the two Gemma-3 ones, 5 s of CPU each) share theirs."""

    @functools.cache
    def shipped(tok_dir: Path, setting: str | None) -> str | None:
        final = tmp_path_factory.mktemp("final")
        save_tokenizer(tok_dir, final, setting)
        return own_template(AutoTokenizer.from_pretrained(final))

    return shipped


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_recipe_ships_the_template_it_trains_with(
    path: Path,
    tiny_llama: Path,
    bare_tokenizer: Path,
    loaded: Callable[[Path], Any],
    shipped_template: Callable[[Path, str | None], str | None],
) -> None:
    cfg = C.load(path)
    tok_dir = _tokenizer_dir(cfg.model.name_or_path, tiny_llama, bare_tokenizer)
    tok = loaded(tok_dir)
    template_before = own_template(tok)
    rendered_with = tokenize_for(cfg.data, tok, str(path)).template
    shipped = shipped_template(tok_dir, cfg.data.chat_template)
    if formats.normalise(cfg.data.format) == "text":
        assert rendered_with is None and shipped == own_template(tok)  # raw text; the tokenizer ships as it was
    else:
        assert rendered_with is not None, (
            f"{path}: conversational data on a model without a chat template: set data.chat_template"
        )
        assert shipped == rendered_with
    assert own_template(tok) == template_before  # the shared tokenizer is as loaded for the next recipe


def test_the_tiny_recipe_trains_what_final_serves(tmp_path: Path, tiny_llama: Path) -> None:
    """The built-in recipe's rows are token for token what final/'s tokenizer renders for them; a
    named template reaches final/ too, and saving without it (control) ships something else."""
    cfg = C.load(REPO / "recipes" / "tiny-cpu.yaml")
    rows = [json.loads(line) for line in Path(builtin_assets.resolve_data(cfg.data.path)).read_text().splitlines()[:3]]
    for setting in (cfg.data.chat_template, "chatml"):
        data_cfg = C.DataConfig(**{**cfg.data.__dict__, "chat_template": setting})
        tok = AutoTokenizer.from_pretrained(tiny_llama)
        t = tokenize_for(data_cfg, tok, "tiny").settle(list(rows[0]), rows)
        out = t({k: [r[k] for r in rows] for k in rows[0]})
        final = tmp_path / f"final-{setting}"
        save_tokenizer(tiny_llama, final, setting)
        served = AutoTokenizer.from_pretrained(final)
        for row, ids in zip(rows, out["input_ids"], strict=True):
            msgs = formats.alpaca_messages(row["instruction"], row["input"])
            prompt = served.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            prompt_ids = served(prompt, add_special_tokens=False)["input_ids"]
            assert ids[: len(prompt_ids)] == prompt_ids  # the served prompt is the trained prefix
        save_tokenizer(tiny_llama, tmp_path / "control", None)
        assert (own_template(AutoTokenizer.from_pretrained(tmp_path / "control")) == own_template(served)) == (
            setting is None
        )
