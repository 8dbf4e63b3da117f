"""Docs say what the code does: the seq_len rule and truncation lines in docs/data.md are the ones
trainer/data/stats.py prints, and docs/chat.md's table of how prompts are built is what
trainer/serve/chat.py does, format by format."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoTokenizer

from trainer.config import DataConfig
from trainer.data.stats import SEQ_LEN_RULE, WARN_SHARE, suggest_seq_len, truncation_lines
from trainer.serve.chat import CONVERSATIONAL, Chat, Conversation

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_data_docs_print_the_seq_len_rule_the_code_uses() -> None:
    text = (DOCS / "data.md").read_text()
    assert "the smallest multiple of 64 holding p99, the one rule spotune uses" in text
    assert SEQ_LEN_RULE == "the smallest multiple of 64 holding p99"
    assert f"more than {WARN_SHARE:.0%} of the trained tokens" in " ".join(text.split())
    # The example block is what the code prints for those figures.
    example = {"seq_len": 256, "examples": 30, "tokens": 40_113, "truncated": 25, "dropped": 0, "tokens_lost": 21_370}
    example |= {"max": 3_012, "trained": 30_950, "trained_lost": 21_370, "answers": 30, "ends_lost": 25}
    for line in truncation_lines(example, 2317):
        assert f"  {line}\n" in text, line
    assert suggest_seq_len(2317) == 2368


def _table(text: str, heading: str) -> dict[str, set[str]]:
    """The two-column table under `heading`: prompt text -> the formats its first cell names."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {row.split("|")[2].strip(): set(re.findall(r"`([a-z_]+)`", row.split("|")[1])) for row in rows}


def test_chat_docs_table_is_how_chat_builds_each_formats_prompt(tiny_tokenizer: Path) -> None:
    text = (DOCS / "chat.md").read_text()
    table = _table(text, "## How a turn becomes a prompt")
    formats = set(typing.get_args(typing.get_type_hints(DataConfig)["format"]))
    assert set().union(*table.values()) == formats and sum(len(v) for v in table.values()) == len(formats)
    templated = next(v for k, v in table.items() if k.startswith("the chat template"))
    plain = next(v for k, v in table.items() if k.startswith("the conversation as plain text"))
    assert plain == {"text"}
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    assert tok.chat_template
    conversation = Conversation(turns=[{"role": "user", "content": "Which city?\n\nFrance"}])
    as_template = tok.apply_chat_template(conversation.messages(), add_generation_prompt=True, return_dict=True)
    as_text = tok("Which city?\n\nFrance\n", add_special_tokens=True)
    for fmt in formats:
        session = SimpleNamespace(source=SimpleNamespace(format=fmt), tokenizer=tok)
        fed = Chat.prompt(session, conversation)  # type: ignore[arg-type]  # the one method, on a stand-in
        want = as_template if fmt in templated else as_text
        assert fed["input_ids"][0].tolist() == list(want["input_ids"]), fmt
    # Without a chat template: the formats that refuse are the conversational ones.
    sentence = " ".join(text.split("A tokenizer with no chat template", 1)[1].split("cannot chat")[0].split())
    assert set(re.findall(r"`([a-z_]+)`", sentence)) - {"data", "chat_template"} == set(CONVERSATIONAL) - {"chat"}
    # ...and the others continue the raw prompt as training tokenised it: special tokens, no separator
    raw = " ".join(
        text.split("A tokenizer with no chat template", 1)[1].split("cannot chat")[1].split("\n\n")[0].split()
    )
    assert "no separator" in raw
    assert set(re.findall(r"`([a-z_]+)`", raw)) == formats - set(CONVERSATIONAL) - {"text"}
    tok.chat_template = None
    as_raw = tok("Which city?\n\nFrance", add_special_tokens=True)
    assert list(as_raw["input_ids"]) != list(as_text["input_ids"])  # control: the two continuations differ
    for fmt in set(re.findall(r"`([a-z_]+)`", raw)) | {"text"}:
        session = SimpleNamespace(source=SimpleNamespace(format=fmt), tokenizer=tok)
        fed = Chat.prompt(session, conversation)  # type: ignore[arg-type]
        assert fed["input_ids"][0].tolist() == list((as_text if fmt == "text" else as_raw)["input_ids"]), fmt


def test_control_the_two_renderings_differ(tiny_tokenizer: Path) -> None:
    """Control: the table's two ways give different tokens, so the comparison above can fail."""
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    conversation = Conversation(turns=[{"role": "user", "content": "Which city?"}])
    templated = tok.apply_chat_template(conversation.messages(), add_generation_prompt=True, return_dict=True)
    plain = tok("Which city?\n", add_special_tokens=True)
    assert list(templated["input_ids"]) != list(plain["input_ids"])
