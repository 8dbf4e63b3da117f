"""Data formats: one conversation written in every format trains the same tokens; `auto` says what it
picked; a file read as the wrong format names the one to set; named templates for base models."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from trainer.config import DataConfig
from trainer.data import DataError, prepare
from trainer.data.chat_templates import NAMED
from trainer.data.template import IGNORE_INDEX, Tokenize, tokenize_for

SYSTEM, USER, ANSWER = "You answer in one word.", "Capital of France?", "Paris"
ROWS: dict[str, dict[str, Any]] = {
    "alpaca": {"system": SYSTEM, "instruction": USER, "input": "", "output": ANSWER},
    "prompt_completion": {
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
        "completion": [{"role": "assistant", "content": ANSWER}],
    },
    "messages": {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": USER},
            {"role": "assistant", "content": ANSWER},
        ]
    },
    "sharegpt": {
        "conversations": [
            {"from": "system", "value": SYSTEM},
            {"from": "human", "value": USER},
            {"from": "gpt", "value": ANSWER},
        ]
    },
}


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tokenized(tok: Any, fmt: str, rows: list[dict[str, Any]], **kw: Any) -> dict[str, list[Any]]:
    cfg = DataConfig(format=fmt, seq_len=512, **kw)  # type: ignore[arg-type]
    t = tokenize_for(cfg, tok, "rows.jsonl").settle(list(rows[0]), rows)
    return t({k: [r.get(k) for r in rows] for k in rows[0]})


def test_one_conversation_in_every_format_trains_the_same_tokens(tiny_tokenizer: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    results = {fmt: _tokenized(tok, fmt, [row]) for fmt, row in ROWS.items()}
    auto = {fmt: _tokenized(tok, "auto", [row]) for fmt, row in ROWS.items()}
    ref = results["messages"]
    rendered = tok.apply_chat_template(ROWS["messages"]["messages"], tokenize=False)
    assert ref["input_ids"][0] == tok(rendered, add_special_tokens=False)["input_ids"]
    trained = [t for t, lab in zip(ref["input_ids"][0], ref["labels"][0], strict=True) if lab != IGNORE_INDEX]
    assert tok.decode(trained) == ANSWER + tok.eos_token
    for fmt in ROWS:
        assert results[fmt] == ref, fmt
        assert auto[fmt] == ref, fmt
    # control: without the system column alpaca renders another conversation
    bare = dict(ROWS["alpaca"], system=None)
    assert _tokenized(tok, "alpaca", [bare])["input_ids"] != ref["input_ids"]
    # LLaMA-Factory's ShareGPT form (messages alike): the system prompt in a `system` column beside the turns,
    # read where the conversation has none of its own (its own is the one rendered, never both)
    for fmt, key in (("sharegpt", "conversations"), ("messages", "messages")):
        column = {key: ROWS[fmt][key][1:], "system": SYSTEM}
        assert _tokenized(tok, fmt, [column]) == ref == _tokenized(tok, "auto", [column]), fmt
        assert _tokenized(tok, fmt, [{key: ROWS[fmt][key], "system": "Another."}]) == ref, fmt
        assert _tokenized(tok, fmt, [{key: ROWS[fmt][key][1:]}])["input_ids"] != ref["input_ids"]  # control


def test_alpaca_history_is_read_as_the_earlier_turns(tiny_tokenizer: Path) -> None:
    """LLaMA-Factory's alpaca `history` ([[query, response], ...]) becomes the turns before the instruction, each
    answer trained (its default, mask_history false), exactly as the same conversation in `messages` form; a
    malformed one is a counted drop naming the column. The earlier turns used to be left out."""
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    row = {"instruction": USER, "input": "", "output": ANSWER, "history": [["Capital of Spain?", "Madrid"]]}
    turns = [("user", "Capital of Spain?"), ("assistant", "Madrid"), ("user", USER), ("assistant", ANSWER)]
    same = {"messages": [{"role": r, "content": c} for r, c in turns]}
    got = _tokenized(tok, "alpaca", [row])
    assert got == _tokenized(tok, "messages", [same]) == _tokenized(tok, "auto", [row])
    trained = [t for t, lab in zip(got["input_ids"][0], got["labels"][0], strict=True) if lab != IGNORE_INDEX]
    assert tok.decode(trained) == "Madrid" + tok.eos_token + ANSWER + tok.eos_token
    assert _tokenized(tok, "alpaca", [dict(row, history=[])])["input_ids"] != got["input_ids"]  # control
    bad = _tokenized(tok, "alpaca", [dict(row, history=["Capital of Spain?"])])
    assert bad["status"] == ["malformed_messages"] and "'history'" in bad["detail"][0], bad


def test_auto_says_what_it_picked_and_why(tmp_path: Path, tiny_tokenizer: Path, capfd: pytest.CaptureFixture) -> None:
    path = _jsonl(tmp_path / "share.jsonl", [ROWS["sharegpt"]])
    p = prepare(DataConfig(path=str(path), seq_len=256), str(tiny_tokenizer), tmp_path / "c", progress=False)
    assert p.manifest["train"]["format"] == "sharegpt"
    assert "data.format=auto -> sharegpt (column 'conversations' holds turns of from/value)" in capfd.readouterr().err
    assert p.manifest["train"]["chat_template"] == "the tokenizer's own"


def test_columns_no_role_reads_are_named_once_per_source(tiny_tokenizer: Path, capfd: pytest.CaptureFixture) -> None:
    """A misnamed column trains nothing: each source says which of its columns its format reads none of (alpaca-style
    pairs read their instruction and input as the prompt)."""
    from trainer.data.pairs import tokenize_pairs_for

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    pair = {"instruction": "Capital?", "input": "France", "chosen": "Paris", "rejected": "Lyon", "lang": "en"}
    tokenize_pairs_for(DataConfig(), tok, "pairs.jsonl").settle(list(pair), [pair])
    err = capfd.readouterr().err
    assert "pairs: prompt 'instruction' + 'input' (alpaca form)" in err
    assert (
        "pairs.jsonl: format preference reads no column 'lang' (only 'instruction', 'input', 'chosen', 'rejected')"
        in err
    )
    _tokenized(tok, "messages", [{**ROWS["messages"], "lang": "en"}])
    assert "rows.jsonl: format messages reads no column 'lang' (only 'messages')" in capfd.readouterr().err
    for fmt, row in ROWS.items():  # control: every column read, nothing said
        _tokenized(tok, fmt, [row])
        assert "reads no column" not in capfd.readouterr().err, fmt


@pytest.mark.parametrize(
    ("data", "read_as", "expected"),
    [
        ("sharegpt", "alpaca", "looks like sharegpt (conversations of from/value)"),
        ("sharegpt", "messages", "looks like sharegpt (conversations of from/value)"),
        ("messages", "alpaca", "looks like messages (a list of role/content)"),
        ("alpaca", "prompt_completion", "looks like alpaca (instruction/input/output)"),
        ("prompt_completion", "text", "looks like prompt_completion (prompt + completion)"),
    ],
)
def test_a_file_of_another_format_names_the_format_to_set(
    tmp_path: Path, tiny_tokenizer: Path, data: str, read_as: str, expected: str
) -> None:
    row = ROWS[data]
    if data == "sharegpt" and read_as == "messages":
        row = {"messages": row["conversations"]}  # from/value turns under a `messages` column
    path = _jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DataError) as e:
        prepare(DataConfig(path=str(path), format=read_as), str(tiny_tokenizer), tmp_path / "c", progress=False)  # type: ignore[arg-type]
    msg = str(e.value)
    assert str(path) in msg and expected in msg and f"set data.format={data}" in msg
    moved = {} if row is ROWS[data] else {"conversations_field": "messages"}
    assert ("and data.conversations_field=messages" in msg) == bool(moved)
    # control: read as the message says, it prepares
    cfg = DataConfig(path=str(path), format=data, **moved)  # type: ignore[arg-type]
    assert prepare(cfg, str(tiny_tokenizer), tmp_path / "c", progress=False).manifest["train"]["examples_out"] == 1


def test_raw_prompt_completion_needs_no_template(tiny_tokenizer: Path) -> None:
    """String prompt/completion on a tokenizer without a chat template stays raw (TRL's standard form)."""
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    tok.chat_template = None
    out = _tokenized(tok, "prompt_completion", [{"prompt": "2 + 3 =", "completion": " 5"}])
    prompt, completion = tok("2 + 3 =")["input_ids"], tok(" 5", add_special_tokens=False)["input_ids"]
    assert out["input_ids"][0] == prompt + completion + [tok.eos_token_id]
    assert out["labels"][0] == [IGNORE_INDEX] * len(prompt) + completion + [tok.eos_token_id]


@pytest.mark.parametrize("name", sorted(NAMED))
def test_a_base_model_trains_with_a_named_template(tiny_tokenizer: Path, name: str) -> None:
    """No template on the tokenizer: alpaca data asks for one; a named one renders and masks, and a
    template that ends turns with no special token gets a trained EOS so generation stops."""
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    tok.chat_template = None
    with pytest.raises(
        DataError, match="has no chat template.*set data.chat_template to one of chatml, llama3, alpaca"
    ):
        _tokenized(tok, "alpaca", [ROWS["alpaca"]])
    out = _tokenized(tok, "alpaca", [ROWS["alpaca"]], chat_template=name)
    ids, labels = out["input_ids"][0], out["labels"][0]
    assert ids[-1] == tok.eos_token_id
    trained = tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])
    end = {"chatml": "<|im_end|>\n", "llama3": "<|eot_id|>", "alpaca": ""}[name]
    assert trained == ANSWER + end + tok.eos_token
    # One run from the answer to the EOS: every token the model must write to reach the stop is
    # trained (an untrained "\n" between `<|im_end|>` and the EOS would leave the stop unlearned).
    first = next(i for i, lab in enumerate(labels) if lab != IGNORE_INDEX)
    assert all(lab != IGNORE_INDEX for lab in labels[first:]), name
    assert SYSTEM in tok.decode(ids) and USER in tok.decode(ids)


def test_a_conversation_without_a_trained_turn_is_a_counted_drop(tiny_tokenizer: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    rows = [
        ROWS["messages"],
        {"messages": ROWS["messages"]["messages"][:2]},
        {"messages": None},
        {"messages": [{"role": "user"}]},
    ]
    out = Tokenize("messages", tok, {"messages": "messages"}, 512, "truncate")(
        {"messages": [r["messages"] for r in rows]}
    )
    assert out["status"] == ["", "no_trainable_tokens", "null_field", "null_field"]
    assert out["detail"] == ["", "no token to train (no assistant turn, or every one untrained)"] + [
        "field 'messages' is missing or null",
        "turn 1 (user) has no content",
    ]


def test_an_unknown_template_name_lists_the_known_ones(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """A misspelt name is never rendered as Jinja text (a template holds `{{` or `{%`)."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(ROWS["alpaca"]) + "\n")
    cfg = DataConfig(path=str(data), chat_template="chatlm", seq_len=256)
    with pytest.raises(DataError) as err:
        prepare(cfg, str(tiny_tokenizer), tmp_path / "cache", progress=False)
    assert str(err.value) == (
        "data.chat_template: 'chatlm' is not a known template; did you mean chatml? set it to one of chatml, "
        "llama3, alpaca, to Jinja text (a template holds {{ or {%), or unset it for the tokenizer's own."
    )
    jinja = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # control: Jinja text is rendered as given
    p = prepare(dataclasses.replace(cfg, chat_template=jinja), str(tiny_tokenizer), tmp_path / "cache", progress=False)
    assert p.manifest["train"]["chat_template"] == "data.chat_template (Jinja)"


def test_auto_says_its_choice_once_per_source(
    tmp_path: Path, tiny_tokenizer: Path, capfd: pytest.CaptureFixture
) -> None:
    """`inspect --show` settles each source before prepare settles it again: the line is printed once."""
    path = _jsonl(tmp_path / "once.jsonl", [ROWS["sharegpt"]])
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    t = tokenize_for(DataConfig(path=str(path), seq_len=256), tok, str(path))
    head = [ROWS["sharegpt"]]
    t.settle(list(ROWS["sharegpt"]), head)
    t.settle(list(ROWS["sharegpt"]), head)
    assert capfd.readouterr().err.count("data.format=auto -> sharegpt") == 1
    other = tmp_path / "other.jsonl"  # control: another source says its own
    tokenize_for(DataConfig(path=str(other), seq_len=256), tok, str(other)).settle(list(ROWS["sharegpt"]), head)
    assert capfd.readouterr().err.count("data.format=auto -> sharegpt") == 1
