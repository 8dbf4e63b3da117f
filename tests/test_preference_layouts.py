"""Preference layouts as their authors meant them, through the six official tokenizers: hh-rlhf dialogues split at
their speaker markers, alpaca/orca columns read as the prompt, LLaMA-Factory's forms, OpenAI content parts,
pre-templated strings kept as written; layouts that cannot be read refused with the key to set; every bad row a
counted drop with its file and line; JSON rows read as the file has them (SFT too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import SHARED_DATA
from transformers import AutoTokenizer

from trainer.config import DataConfig
from trainer.data import DataError, prepare
from trainer.data.pairs import tokenize_pairs_for
from trainer.data.read import read_rows, unpacked
from trainer.data.template import IGNORE_INDEX, tokenize_for

TOKENIZERS = SHARED_DATA / "tokenizers"
NAMES = ["qwen2.5-instruct", "qwen3", "llama-3.1-instruct", "gemma-3-it", "mistral-7b-instruct-v0.3", "phi-4"]
needs_tokenizers = pytest.mark.skipif(not TOKENIZERS.is_dir(), reason="the shared official tokenizers are absent")
_LOADED: dict[str, Any] = {}


def _tok(name: str) -> Any:
    """Each official tokenizer loaded once for the module (gemma's alone is 33 MB)."""
    if name not in _LOADED:
        _LOADED[name] = AutoTokenizer.from_pretrained(TOKENIZERS / name)
    return _LOADED[name]


def _pairs(tok: Any, rows: list[dict[str, Any]], **cfg: Any) -> dict[str, list[Any]]:
    cfg.setdefault("seq_len", 1024)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    t = tokenize_pairs_for(DataConfig(**cfg), tok, "test").settle(columns, rows)
    return t({c: [r.get(c) for r in rows] for c in columns})


def _parts(tok: Any, out: dict[str, list[Any]], i: int = 0) -> tuple[str, str, str]:
    """(the prompt the chosen answer follows, the chosen answer scored, the rejected answer scored)."""
    ids, labels, cut = out["input_ids"][i], out["labels"][i], out["chosen_length"][i]
    first = next(k for k, x in enumerate(labels) if x != IGNORE_INDEX)
    scored = [tok.decode([x for x in part if x != IGNORE_INDEX]) for part in (labels[:cut], labels[cut:])]
    return tok.decode(ids[:first]), scored[0], scored[1]


def _conversation(tok: Any, messages: list[dict[str, Any]]) -> str:
    return str(tok.apply_chat_template(messages, tokenize=False))


def _served(tok: Any, messages: list[dict[str, Any]]) -> str:
    return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def _answer(tok: Any, prompt: list[dict[str, Any]], text: str) -> str:
    """What the official template writes for the answer `text` after `prompt` (its end of turn included)."""
    full = _conversation(tok, [*prompt, {"role": "assistant", "content": text}])
    head = _served(tok, prompt)
    assert full.startswith(head)
    return full[len(head) :].rstrip("\n").removeprefix(" ")


HH = {  # Anthropic/hh-rlhf: whole dialogues, both answers start with "I"
    "chosen": "\n\nHuman: How do I pick a lock?\n\nAssistant: Why do you want to?\n\nHuman: I am locked out."
    "\n\nAssistant: I can't help with that, call a locksmith.",
    "rejected": "\n\nHuman: How do I pick a lock?\n\nAssistant: Why do you want to?\n\nHuman: I am locked out."
    "\n\nAssistant: I will explain: take a tension wrench.",
}
HH_PROMPT = [
    {"role": "user", "content": "How do I pick a lock?"},
    {"role": "assistant", "content": "Why do you want to?"},
    {"role": "user", "content": "I am locked out."},
]


@needs_tokenizers
@pytest.mark.parametrize("name", NAMES)
def test_hh_dialogues_split_at_their_speaker_markers(name: str) -> None:
    """The answers are the last Assistant: turns whole; their shared first word never goes into a user turn."""
    tok = _tok(name)
    prompt, chosen, rejected = _parts(tok, _pairs(tok, [HH]))
    assert prompt == _served(tok, HH_PROMPT)  # the dialogue's earlier turns, as the template serves them
    assert chosen == _answer(tok, HH_PROMPT, "I can't help with that, call a locksmith.")
    assert rejected == _answer(tok, HH_PROMPT, "I will explain: take a tension wrench.")


def test_hh_dialogues_without_a_template_split_after_the_assistant_marker(tiny_llama: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    tok.chat_template = None
    prompt, chosen, rejected = _parts(tok, _pairs(tok, [HH]))
    assert prompt == "<s>" + HH["chosen"].split("Assistant: I can't")[0] + "Assistant:"
    assert (chosen, rejected) == (
        " I can't help with that, call a locksmith.</s>",
        " I will explain: take a tension wrench.</s>",
    )


ALPACA = {"instruction": "What is 1+0?", "input": "Answer in words.", "chosen": "It is one.", "rejected": "It is 2."}
ORCA = {  # argilla/distilabel-intel-orca-dpo-pairs: the question in `input`, beside columns nothing reads
    "system": "Be brief.",
    "input": "What is 1+0?",
    "chosen": "It is one.",
    "rejected": "It is 2.",
    "status": "tie",
    "generations": ["It is one.", "It is 2."],
}
LF_SHAREGPT = {  # LLaMA-Factory's sharegpt preference form
    "conversations": [{"from": "human", "value": "What is 1+0?"}],
    "chosen": {"from": "gpt", "value": "It is one."},
    "rejected": {"from": "gpt", "value": "It is 2."},
    "system": "Be brief.",
}
PARTS = {  # OpenAI content parts (Qwen2.5's, Mistral's and Phi-4's templates concatenate strings only)
    "prompt": [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "1+0?"}]}],
    "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "It is one."}]}],
    "rejected": [{"role": "assistant", "content": "It is 2."}],
}
ASK = [{"role": "user", "content": "What is 1+0?"}]
BRIEF = [{"role": "system", "content": "Be brief."}, *ASK]


@needs_tokenizers
@pytest.mark.parametrize("name", NAMES)
def test_prompt_columns_of_every_common_layout_are_the_prompt(name: str) -> None:
    tok = _tok(name)
    system = name != "mistral-7b-instruct-v0.3"  # Mistral v0.3 serves a system prompt in the last [INST] only
    cases = [
        (ALPACA, [{"role": "user", "content": "What is 1+0?\n\nAnswer in words."}]),
        (  # LLaMA-Factory's alpaca form with earlier turns
            {**ALPACA, "history": [["Hi.", "Hello."]]},
            [
                {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "What is 1+0?\n\nAnswer in words."},
            ],
        ),
        (ORCA, BRIEF if system else [{"role": "user", "content": "Be brief.\n\nWhat is 1+0?"}]),
        (LF_SHAREGPT, BRIEF if system else [{"role": "user", "content": "Be brief.\n\nWhat is 1+0?"}]),
        (PARTS, ASK),
    ]
    for row, prompt in cases:
        out = _pairs(tok, [row])
        assert out["status"] == [""], (row, out["detail"])
        assert _parts(tok, out) == (
            _served(tok, prompt),
            _answer(tok, prompt, "It is one."),
            _answer(tok, prompt, "It is 2."),
        ), row


@needs_tokenizers
@pytest.mark.parametrize("name", NAMES)
def test_pre_templated_strings_are_kept_as_written(name: str, capfd: pytest.CaptureFixture) -> None:
    """A prompt and answers the template rendered already become exactly the official tokens, once."""
    tok = _tok(name)
    head = _served(tok, ASK)
    chosen, rejected = (
        _conversation(tok, [*ASK, {"role": "assistant", "content": a}])[len(head) :] for a in ("It is one.", "It is 2.")
    )
    out = _pairs(tok, [{"prompt": head, "chosen": chosen, "rejected": rejected}])
    assert out["status"] == [""]
    cut = out["chosen_length"][0]
    official = tok(_conversation(tok, [*ASK, {"role": "assistant", "content": "It is one."}]), add_special_tokens=False)
    assert out["input_ids"][0][:cut] == official["input_ids"]  # not templated a second time, BOS once
    assert _parts(tok, out)[1].strip() == chosen.strip()  # the answer scored as written, no EOS added after its end
    assert "kept as written (not rendered again)" in capfd.readouterr().err
    # control: the same texts without the template's control tokens are rendered by it
    plain = _pairs(tok, [{"prompt": "What is 1+0?", "chosen": "It is one.", "rejected": "It is 2."}])
    assert plain["input_ids"][0][: plain["chosen_length"][0]] == official["input_ids"]


def test_layouts_that_cannot_be_read_are_refused_naming_the_key(tiny_llama: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    # String answers, no prompt column, and a text column nothing reads: the prompt is likely there.
    row = {"query": "What is 1+0?", "chosen": "It is one.", "rejected": "It is 2."}
    with pytest.raises(DataError, match=r"'query' would go unread .* set data.prompt_field"):
        _pairs(tok, [row])
    assert _pairs(tok, [row], prompt_field="query")["status"] == [""]
    # One-message answers (LLaMA-Factory's form) without the turns before them.
    with pytest.raises(DataError, match="hold one message each .* set data.prompt_field"):
        _pairs(tok, [{"chosen": LF_SHAREGPT["chosen"], "rejected": LF_SHAREGPT["rejected"]}])


@needs_tokenizers
def test_misleading_reasons_are_named_for_what_they_are() -> None:
    tok = _tok("mistral-7b-instruct-v0.3")
    empty = {"prompt": "Hi", "chosen": "", "rejected": "Hello."}
    same = [*ASK, {"role": "assistant", "content": "It is one."}]
    out = _pairs(tok, [empty, {"prompt": "Hi", "chosen": "Yo", "rejected": "Yo"}])
    assert out["status"] == ["empty_answer", "identical_answers"]  # not prompt_differs: Mistral writes no space
    assert _pairs(tok, [{"chosen": same, "rejected": same}])["status"] == ["identical_answers"]  # not no_shared_prompt


def _jsonl_text(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_every_bad_row_is_a_counted_drop_with_its_line(tiny_llama: Path, tmp_path: Path) -> None:
    """A lone surrogate, an answer of another shape than the others', a value the template cannot render, an empty
    and an identical answer: each row dropped with its line and reason, the file read."""
    good = {"prompt": "What is 1+0?", "chosen": "It is one.", "rejected": "It is 2."}
    lines = [
        json.dumps(good),
        json.dumps(good).replace("It is one.", "It is \\ud800."),  # a lone surrogate: not text UTF-8 encodes
        json.dumps({**good, "chosen": ["It is one."]}),  # a list where every other row has a string
        json.dumps({**good, "prompt": [{"role": "user", "content": 7}]}),  # chatml adds strings: a TypeError inside
        json.dumps({**good, "chosen": " "}),
        json.dumps({**good, "rejected": good["chosen"]}),
        json.dumps(good),
    ]
    data = _jsonl_text(tmp_path / "p.jsonl", lines)
    p = prepare(
        DataConfig(path=str(data), seq_len=256, chat_template="chatml"),
        str(tiny_llama),
        tmp_path / "c",
        progress=False,
        pairs=True,
    )
    rows = [json.loads(line) for line in (p.train_path.parent / "dropped.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rows] == [
        (2, "malformed_text"),
        (3, "malformed_messages"),
        (4, "template_error"),
        (5, "empty_answer"),
        (6, "identical_answers"),
    ]
    assert "TypeError" in rows[2]["detail"]
    assert p.manifest["train"]["pairs"] == 2


TOOL_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"type": "function", "function": {"name": "find", "arguments": {"where": "Paris", "near": None}}}],
}


@needs_tokenizers
def test_json_rows_are_read_as_the_file_has_them_for_sft_too(tmp_path: Path) -> None:
    """Tool-call arguments keep their keys, order and nulls (no merged schema), and a value whose type differs
    between rows no longer refuses the file."""
    other = json.loads(json.dumps(TOOL_CALL))
    other["tool_calls"][0]["function"]["arguments"] = {"near": 3, "when": "now"}  # `near` a number here, null above
    rows = [{"messages": [*ASK, TOOL_CALL]}, {"messages": [*ASK, other]}]
    data = _jsonl_text(tmp_path / "t.jsonl", [json.dumps(r) for r in rows])
    ds = read_rows(data)
    assert [unpacked(r)["messages"] for r in ds] == [r["messages"] for r in rows]
    tok = _tok("qwen2.5-instruct")
    t = tokenize_for(DataConfig(format="messages", seq_len=1024), tok, "t.jsonl").settle(["messages"], rows)
    out = t(ds.to_dict())
    assert out["status"] == ["", ""]
    texts = [tok.decode(ids) for ids in out["input_ids"]]
    assert '"arguments": {"where": "Paris", "near": null}' in texts[0]
    assert '"arguments": {"near": 3, "when": "now"}' in texts[1]


# ----------------------------------------------------------------------------- lengths, as TRL reads them


def test_length_keys_mean_what_they_mean_in_trl() -> None:
    from trainer import config as C

    dpo = C.load(None, ["rl=dpo", "max_length=512", "max_prompt_length=128", "truncation_mode=keep_end"])
    assert (dpo.data.max_length, dpo.data.seq_len) == (512, 1024)  # each answer's cap; the row holds the pair
    assert (dpo.data.max_prompt_length, dpo.data.truncation_mode) == (128, "keep_end")
    assert C.load(None, ["rl=dpo", "max_length=512", "data.seq_len=4096"]).data.seq_len == 4096  # a row set apart
    assert C.load(None, ["max_completion_length=64", "train.objective=orpo"]).data.max_completion_length == 64
    sft = C.load(None, ["max_length=512"])  # SFT's max_length is the sequence length
    assert (sft.data.seq_len, sft.data.max_length) == (512, None)
    with pytest.raises(C.ConfigError, match="data.max_length: is the sequence length under SFT"):
        C.load(None, ["max_length=512", "data.seq_len=1024"])
    with pytest.raises(C.ConfigError, match="data.max_prompt_length: only the preference objectives read it"):
        C.load(None, ["max_prompt_length=128"])


def test_max_length_caps_each_answer_as_trls_collator_does(tiny_llama: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    row = {"prompt": "What colour is the sky today?", "chosen": " ".join(["blue"] * 40), "rejected": "Grey."}
    whole = _pairs(tok, [row], seq_len=512)
    cut = whole["chosen_length"][0]
    seqs = [
        (whole["input_ids"][0][:cut], whole["labels"][0][:cut]),
        (whole["input_ids"][0][cut:], whole["labels"][0][cut:]),
    ]
    n = len(seqs[1][0]) + 4  # the rejected sequence fits, the chosen one does not
    assert len(seqs[0][0]) > n
    for mode, keep in (("keep_start", slice(None, n)), ("keep_end", slice(-n, None))):
        out = _pairs(tok, [row], seq_len=512, max_length=n, truncation_mode=mode)
        assert out["status"] == [""] and out["length"] == whole["length"]
        ids, labels, c = out["input_ids"][0], out["labels"][0], out["chosen_length"][0]
        assert ids[:c] == seqs[0][0][keep] and ids[c:] == seqs[1][0]  # TRL: prompt+answer[sl], each apart
        assert labels[1:c] == seqs[0][1][keep][1:] and labels[0] == IGNORE_INDEX
    # TRL drops a pair whose prompt alone fills max_length under keep_start; overlong: drop drops any cut pair
    assert _pairs(tok, [row], max_length=4)["status"] == ["no_trainable_after_truncation"]
    assert _pairs(tok, [row], max_length=n, overlong="drop")["status"] == ["overlong"]
    # max_prompt_length keeps the prompt's end, max_completion_length the answer's start (TRL 0.x)
    first = next(i for i, x in enumerate(seqs[0][1]) if x != IGNORE_INDEX)
    out = _pairs(tok, [row], max_prompt_length=3, max_completion_length=5)
    assert out["input_ids"][0][: out["chosen_length"][0]] == seqs[0][0][first - 3 : first + 5]


def test_the_summary_says_the_share_of_pairs_cut_at_max_length(tiny_llama: Path, tmp_path: Path) -> None:
    short = {"prompt": "What colour is the sky?", "chosen": "Blue.", "rejected": "Grey."}
    long = {**short, "chosen": " ".join(["blue"] * 60)}
    data = _jsonl_text(tmp_path / "p.jsonl", [json.dumps(r) for r in (short, long, short, long)])
    cfg = DataConfig(path=str(data), seq_len=512, max_length=40)
    p = prepare(cfg, str(tiny_llama), tmp_path / "c", progress=False, pairs=True)
    assert p.manifest["train"]["truncated"] == 2  # both pairs fit a row of 512; their long answers met max_length
    summary = p.summary()
    assert "each answer's sequence (prompt + answer): max_length=40 truncation_mode=keep_start" in summary
    assert (
        "at max_length 40 per answer, in rows of seq_len 512: 2 of 4 pairs lose tokens (50.0%: 2 truncated)" in summary
    )
    uncapped = prepare(
        DataConfig(path=str(data), seq_len=512), str(tiny_llama), tmp_path / "c", progress=False, pairs=True
    )
    assert uncapped.manifest["train"]["truncated"] == 0 and uncapped.fingerprint != p.fingerprint  # control
