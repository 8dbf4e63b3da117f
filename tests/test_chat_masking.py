"""Masking on the REAL official tokenizers (the shared data's tokenizers/, conftest.SHARED_DATA): exactly the assistant's text and its
end-of-turn token carry labels, including templates that rewrite earlier turns once later ones arrive."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from conftest import SHARED_DATA
from transformers import AutoTokenizer

from trainer.data.formats import SHAREGPT_ROLES
from trainer.data.template import IGNORE_INDEX, TEMPLATE_ERROR, Tokenize

TOKENIZERS = SHARED_DATA / "tokenizers"
pytestmark = pytest.mark.skipif(not TOKENIZERS.is_dir(), reason=f"{TOKENIZERS} is absent (the shared data)")

SYSTEM, Q1, Q2 = "You are a terse geographer.", "What is the capital of France?", "And of Italy?"
A1 = "<think>France is in Europe.</think>Paris is the capital."
A2 = "<think>\nItaly, then.\n</think>\n\nRome."
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": Q1},
    {"role": "assistant", "content": A1},
    {"role": "user", "content": Q2},
    {"role": "assistant", "content": A2},
]
# What each template renders as the assistant's turns (its own rewrites included) + the end-of-turn token.
CASES: dict[str, tuple[str, list[str]]] = {
    "llama-3.1-instruct": ("<|eot_id|>", [A1, A2]),
    "qwen2.5-instruct": ("<|im_end|>", [A1, A2]),
    # Qwen3 strips the reasoning of every assistant turn before the last user message.
    "qwen3": ("<|im_end|>", ["Paris is the capital.", A2]),
    "gemma-3-it": ("<end_of_turn>", [A1, A2]),
    "mistral-7b-instruct-v0.3": ("</s>", [A1, A2]),
    "phi-4": ("<|im_end|>", [A1, A2]),
}
# Mistral v0.3 writes the system prompt only into the [INST] before the generation prompt: trained
# there, inside the last user turn, as a chat endpoint serves it.
TRAINED_AS = {
    "mistral-7b-instruct-v0.3": [*CONVERSATION[1:3], {"role": "user", "content": f"{SYSTEM}\n\n{Q2}"}, CONVERSATION[4]]
}
# Templates where rendering prefixes (the former method) cannot locate the turns.
PREFIX_METHOD_FAILS = {"qwen3", "mistral-7b-instruct-v0.3"}


@cache
def _tokenizer(name: str) -> Any:
    return AutoTokenizer.from_pretrained(TOKENIZERS / name)


def _labels(name: str, conversation: list[dict[str, Any]], **kw: Any) -> tuple[list[int], list[int], str]:
    tok = _tokenizer(name)
    out = Tokenize("messages", tok, {"messages": "messages"}, 4096, "truncate", **kw)({"messages": [conversation]})
    assert out["status"] == [""]
    return out["input_ids"][0], out["labels"][0], out["status"][0]


def _runs(tok: Any, ids: list[int], labels: list[int]) -> list[str]:
    """The decoded runs of consecutive labelled tokens; every label is its token or IGNORE_INDEX."""
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ids, labels, strict=True))
    runs: list[list[int]] = []
    for i, lab in enumerate(labels):
        if lab == IGNORE_INDEX:
            continue
        if i and labels[i - 1] != IGNORE_INDEX and runs:
            runs[-1].append(lab)
        else:
            runs.append([lab])
    return [tok.decode(r) for r in runs]


@pytest.mark.parametrize("name", sorted(CASES))
def test_only_assistant_text_and_end_of_turn_are_trained(name: str) -> None:
    tok = _tokenizer(name)
    eot, answers = CASES[name]
    ids, labels, _ = _labels(name, CONVERSATION)
    rendered = tok.apply_chat_template(TRAINED_AS.get(name, CONVERSATION), tokenize=False)
    assert ids == tok(rendered, add_special_tokens=False)["input_ids"]  # the template's tokens, nothing added
    assert _runs(tok, ids, labels) == [a + eot for a in answers]
    # no user or system character is under a labelled token
    offsets = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    for text in (SYSTEM, Q1, Q2):
        at = rendered.find(text)
        assert at >= 0, text
        inside = [lab for lab, (s, e) in zip(labels, offsets, strict=True) if s < at + len(text) and e > at]
        assert inside and all(lab == IGNORE_INDEX for lab in inside), text
    # control: the same comparison fails for labels one token off
    shifted = [IGNORE_INDEX, *labels[:-1]]
    assert _runs(tok, ids, [t if lab != IGNORE_INDEX else lab for t, lab in zip(ids, shifted, strict=True)]) != [
        a + eot for a in answers
    ]


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_last_turn_trains_on_the_prompt_a_chat_endpoint_sends(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What precedes the last assistant turn in a training row is, token for token, what the template
    renders to serve that conversation (system prompt included) with the generation prompt."""
    tok = _tokenizer(name)
    served = tok(
        tok.apply_chat_template(CONVERSATION[:4], tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )["input_ids"]
    ids, _, _ = _labels(name, CONVERSATION)
    assert ids[: len(served)] == served
    if name == "mistral-7b-instruct-v0.3":  # the control: rendered as the template renders a finished conversation
        from trainer.data import masking

        monkeypatch.setattr(masking, "system_served_late", lambda render: False)
        ids, _, _ = _labels(name, CONVERSATION)
        assert ids[: len(served)] != served


def _prefix_method(tok: Any, conversation: list[dict[str, Any]]) -> list[str] | None:
    """The former method: a turn's text = render(messages[:i+1]) - render(messages[:i], gen prompt);
    None where the prefixes do not render as prefixes of the whole."""
    full = tok.apply_chat_template(conversation, tokenize=False)
    found = []
    for i, m in enumerate(conversation):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(conversation[:i], tokenize=False, add_generation_prompt=True)
        upto = tok.apply_chat_template(conversation[: i + 1], tokenize=False)
        if not (full.startswith(upto) and upto.startswith(before)):
            return None
        found.append(upto[len(before) :])
    return found


@pytest.mark.parametrize("name", sorted(PREFIX_METHOD_FAILS))
def test_control_the_prefix_method_fails_where_templates_rewrite_turns(name: str) -> None:
    assert _prefix_method(_tokenizer(name), CONVERSATION) is None
    assert _prefix_method(_tokenizer("qwen2.5-instruct"), CONVERSATION) is not None  # it worked elsewhere


def test_last_assistant_and_train_on_inputs() -> None:
    tok = _tokenizer("qwen2.5-instruct")
    ids, labels, _ = _labels("qwen2.5-instruct", CONVERSATION, train_on="last_assistant")
    assert _runs(tok, ids, labels) == [A2 + "<|im_end|>"]
    ids, labels, _ = _labels("qwen2.5-instruct", CONVERSATION, train_on_inputs=True)
    assert labels == [IGNORE_INDEX, *ids[1:]]


def test_untrained_turns_and_refused_conversations_are_counted() -> None:
    """A `weight: 0` turn is context only; a conversation the template refuses is a counted drop."""
    tok = _tokenizer("gemma-3-it")
    turns = [{"from": "human", "value": Q1}, {"from": "gpt", "value": A1, "weight": 0}]
    turns += [{"from": "human", "value": Q2}, {"from": "gpt", "value": A2}]
    not_alternating = [{"from": "human", "value": Q1}, {"from": "human", "value": Q2}, {"from": "gpt", "value": A2}]
    stranger = [{"from": "narrator", "value": Q1}, {"from": "gpt", "value": A2}]
    tokenize = Tokenize("sharegpt", tok, {"conversations": "conversations"}, 4096, "truncate")
    out = tokenize({"conversations": [turns, not_alternating, stranger]})
    assert out["status"] == ["", TEMPLATE_ERROR, "unknown_role"]
    assert _runs(tok, out["input_ids"][0], out["labels"][0]) == [A2 + "<end_of_turn>"]
    mapped = Tokenize(
        "sharegpt",
        tok,
        {"conversations": "conversations"},
        4096,
        "truncate",
        roles={**SHAREGPT_ROLES, "narrator": "user"},
    )({"conversations": [stranger]})
    assert mapped["status"] == [""]


# ----------------------------------------------------------------------------- tool calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
ASK, RESULT, ANSWER = "Weather in Paris?", '{"temp_c": 21}', "It is 21 degrees."
CALL = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
# As OpenAI's fine-tuning files hold it: a call's content null, its arguments JSON text.
TOOL_CONVERSATION = [
    {"role": "user", "content": ASK},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [dict(CALL, function={**CALL["function"], "arguments": '{"city": "Paris"}'})],
    },
    {"role": "tool", "tool_call_id": "call00001", "content": RESULT},
    {"role": "assistant", "content": ANSWER},
]
# What each template that renders tools writes as the model's turns: the call, then the answer.
TOOL_CASES: dict[str, list[str]] = {
    "qwen2.5-instruct": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    ],
    "qwen3": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'],
    "llama-3.1-instruct": ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'],
    "mistral-7b-instruct-v0.3": [
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>'
    ],
}
ANSWERS = {"qwen2.5-instruct": ANSWER + "<|im_end|>", "qwen3": f"<think>\n\n</think>\n\n{ANSWER}<|im_end|>"}
ANSWERS |= {"llama-3.1-instruct": ANSWER + "<|eot_id|>", "mistral-7b-instruct-v0.3": ANSWER + "</s>"}


def _tool_labels(name: str, conversation: list[dict[str, Any]], tools: Any = None) -> dict[str, list[Any]]:
    fields = {"messages": "messages", "tools": "tools"}
    return Tokenize("messages", _tokenizer(name), fields, 4096, "truncate")(
        {"messages": [conversation], "tools": [tools]}
    )


@pytest.mark.parametrize("name", sorted(TOOL_CASES))
def test_tool_calls_and_answers_are_trained_tool_results_and_tools_are_not(name: str) -> None:
    tok = _tokenizer(name)
    out = _tool_labels(name, TOOL_CONVERSATION, json.dumps(TOOLS))  # the tools column as JSON text
    ids, labels = out["input_ids"][0], out["labels"][0]
    served = [TOOL_CONVERSATION[0], dict(TOOL_CONVERSATION[1], content="", tool_calls=[CALL]), *TOOL_CONVERSATION[2:]]
    rendered = tok.apply_chat_template(served, tools=TOOLS, tokenize=False)
    assert (
        ids == tok(rendered, add_special_tokens=False)["input_ids"]
    )  # the template's own rendering, tools header included
    assert _runs(tok, ids, labels) == [*TOOL_CASES[name], ANSWERS[name]]
    offsets = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    for text in (ASK, "temp_c", "Weather in a city."):  # the question, the tool's result, the tools header
        at = rendered.find(text)
        assert at >= 0, text
        inside = [lab for lab, (s, e) in zip(labels, offsets, strict=True) if s < at + len(text) and e > at]
        assert inside and all(lab == IGNORE_INDEX for lab in inside), text
    # control: the call's turn marked untrained leaves only the answer; the comparison sees the call
    untrained = [TOOL_CONVERSATION[0], dict(TOOL_CONVERSATION[1], weight=0), *TOOL_CONVERSATION[2:]]
    out = _tool_labels(name, untrained, TOOLS)  # the tools column as a list of schemas
    assert out["input_ids"][0] == ids and _runs(tok, ids, out["labels"][0]) == [ANSWERS[name]]


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "llama-3.1-instruct"])
def test_sharegpt_function_call_and_observation_are_a_tool_call_and_its_result(name: str) -> None:
    """LLaMA-Factory's ShareGPT tool rows (a `function_call` turn whose value is the call, an
    `observation`, the tools as JSON text) train exactly as the OpenAI form of the same conversation."""
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    turns = [{"from": "human", "value": ASK}, {"from": "function_call", "value": call}]
    turns += [{"from": "observation", "value": RESULT}, {"from": "gpt", "value": ANSWER}]
    fields = {"conversations": "conversations", "tools": "tools"}
    sharegpt = Tokenize("sharegpt", _tokenizer(name), fields, 4096, "truncate")(
        {"conversations": [turns], "tools": [json.dumps(TOOLS)]}
    )
    no_ids = [TOOL_CONVERSATION[0], dict(TOOL_CONVERSATION[1], tool_calls=[{"function": CALL["function"]}])]
    openai = _tool_labels(name, [*no_ids, {"role": "tool", "content": RESULT}, TOOL_CONVERSATION[3]], TOOLS)
    assert sharegpt["status"] == [""] and sharegpt["input_ids"] == openai["input_ids"]
    assert sharegpt["labels"] == openai["labels"]
    assert _runs(_tokenizer(name), sharegpt["input_ids"][0], sharegpt["labels"][0]) == [
        *TOOL_CASES[name],
        ANSWERS[name],
    ]


def test_a_template_without_tools_drops_tool_rows_by_reason() -> None:
    """Phi-4's template writes no tool calls (Gemma 3's refuses a tool turn): such a row is a counted
    drop that says why, never a conversation trained without its calls; a call that is not JSON names its turn."""
    out = _tool_labels("phi-4", TOOL_CONVERSATION, TOOLS)
    assert out["status"] == [TEMPLATE_ERROR] and out["detail"] == ["the chat template does not render tool calls"]
    out = _tool_labels("gemma-3-it", TOOL_CONVERSATION, TOOLS)
    assert out["status"] == [TEMPLATE_ERROR] and "roles must alternate" in out["detail"][0]  # the template's words
    broken = [
        TOOL_CONVERSATION[0],
        dict(TOOL_CONVERSATION[1], tool_calls=[{"function": {"name": "f", "arguments": "{"}}]),
    ]
    out = _tool_labels("qwen2.5-instruct", broken)
    assert out["status"] == ["malformed_messages"] and out["detail"][0].startswith("turn 2: the arguments of 'f'")


def test_a_tool_file_prepares_every_row_with_its_tools(tmp_path: Path) -> None:
    """OpenAI's fine-tuning JSONL (tools as objects, arguments as JSON text) whose first row calls
    nothing: the later row keeps its tools and calls, trained as the template writes them."""
    from trainer.config import DataConfig
    from trainer.data import prepare

    plain = {"messages": [{"role": "user", "content": Q1}, {"role": "assistant", "content": "Paris."}]}
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (plain, {"messages": TOOL_CONVERSATION, "tools": TOOLS})))
    name = "qwen2.5-instruct"
    p = prepare(DataConfig(path=str(data), seq_len=1024), str(TOKENIZERS / name), tmp_path / "cache", progress=False)
    assert p.manifest["train"]["examples_out"] == 2 and p.manifest["train"]["format"] == "messages"
    import datasets  # here, not at collection: ~1 s with pandas, on a worker that may never run this

    row = datasets.load_from_disk(str(p.train_path))[0]
    real = row["num_real"]
    runs = _runs(_tokenizer(name), row["input_ids"][:real], row["labels"][:real])
    assert [*TOOL_CASES[name], ANSWERS[name]] in [runs[:2], runs[1:]]  # packed beside the plain row
