"""A conversation's turns -> the chat messages a template renders, tool calls included.

Turns are role/content messages (OpenAI's form) or ShareGPT's from/value. OpenAI's function calling
is kept as the templates read it (Qwen2.5/Qwen3, Llama 3.1 and Mistral v0.3 render it natively):
an assistant message with `tool_calls` (its `content` may be null), `tool` messages with the
results, and the conversation's `tools` (function schemas) passed beside the messages. ShareGPT's
`function_call` turn (its value a JSON call, `{"name", "arguments"}` or a list of them) becomes
such an assistant message and its `observation` a `tool` message.

Tool calls are normalised to `{"type": "function", "function": {"name", "arguments": {...}}}` (+ `id`):
arguments as an object, since templates write them with `tojson` (OpenAI stores them as a JSON string).
Rows come as their file has them (key order and JSON nulls kept: trainer/data/read.py's `unpacked`, which
also removes the None fillers Arrow puts into the structs of Parquet and saved datasets).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TOOL_CALL = "tool_call"
"""The role of a ShareGPT speaker whose value is a call (`function_call` by default): an assistant turn with tool calls."""

# Drop reasons a row can get here (the rest live in template.py).
NULL_FIELD = "null_field"
UNKNOWN_ROLE = "unknown_role"
BAD_MESSAGES = "malformed_messages"
BAD_TOOLS = "malformed_tools"
BAD_TEXT = "malformed_text"
"""Drop reason: a column the format reads holds text that is not Unicode text UTF-8 can encode (a lone surrogate)."""


@dataclass(frozen=True)
class Example:
    """One row, ready to render: a conversation, raw text, or a raw prompt + completion."""

    messages: list[dict[str, Any]] | None = None
    trainable: list[bool] | None = None  # per message: may it carry labels (only assistant ones ever do)
    text: str | None = None
    prompt: str | None = None  # raw prompt/completion (no chat template anywhere)
    tools: list[dict[str, Any]] | None = None  # function schemas the conversation may call (the template's tools=)


@dataclass(frozen=True)
class Drop:
    """Why a row is not trained: `reason` is counted in the manifest, `detail` says which field or turn."""

    reason: str
    detail: str = ""


def messages_of(turns: Any, roles: dict[str, str] | None) -> Example | Drop:
    """role/content (or, with `roles` for ShareGPT, from/value) turns -> messages; `weight: 0` marks a
    turn untrained."""
    if not isinstance(turns, (list, tuple)):
        return Drop(BAD_MESSAGES, f"expected a list of turns, got {type(turns).__name__}")
    msgs: list[dict[str, Any]] = []
    trainable: list[bool] = []
    for n, t in enumerate(turns, start=1):
        if not isinstance(t, dict):
            return Drop(BAD_MESSAGES, f"turn {n} is a {type(t).__name__}, not a mapping")
        msg = _message(t, roles, n)
        if isinstance(msg, Drop):
            return msg
        msgs.append(msg)
        trainable.append(msg["role"] == "assistant" and t.get("weight", 1) not in (0, False))
    return Example(messages=msgs, trainable=trainable)


def _message(t: dict[str, Any], roles: dict[str, str] | None, n: int) -> dict[str, Any] | Drop:
    sharegpt = "from" in t
    role, content = (t.get("from"), t.get("value")) if sharegpt else (t.get("role"), t.get("content"))
    if role is None:
        return Drop(BAD_MESSAGES, f"turn {n} has no {'from' if sharegpt else 'role'}")
    if roles is not None:
        if role not in roles:
            return Drop(UNKNOWN_ROLE, f"turn {n}: speaker {role!r} is not mapped (data.sharegpt_roles)")
        role = roles[role]
    msg = {k: v for k, v in t.items() if k not in ("from", "value", "weight")}
    if role == TOOL_CALL:  # ShareGPT's function_call: its value is the call
        calls = tool_calls_of(content, n)
        return calls if isinstance(calls, Drop) else {**msg, "role": "assistant", "content": "", "tool_calls": calls}
    if role == "assistant" and "tool_calls" in msg:
        calls = tool_calls_of(msg["tool_calls"], n)
        if isinstance(calls, Drop):
            return calls
        # A call often has no text (OpenAI's null content); templates concatenate strings.
        return {**msg, "role": role, "content": "" if content is None else content, "tool_calls": calls}
    if content is None:
        return Drop(NULL_FIELD, f"turn {n} ({role}) has no {'value' if sharegpt else 'content'}")
    return {**msg, "role": role, "content": text_of(content)}


def text_of(content: Any) -> Any:
    """OpenAI's content parts (`[{"type": "text", "text": ...}, ...]`) as the one string they spell, their texts
    joined as the templates that read parts join them; other content (a string, parts that are not all text:
    an image) as it is. Templates that read only strings (Qwen2.5, Mistral v0.3, Phi-4) then render it."""
    if isinstance(content, (list, tuple)) and content and all(_text_part(p) for p in content):
        return "".join(p["text"] for p in content)
    return content


def _text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def bad_text(row: dict[str, Any], fields: dict[str, str]) -> Drop | None:
    """A Drop when a column of `fields` in `row` holds text that UTF-8 cannot encode (JSON's lone surrogate
    `\\ud800`): the tokenizer would fail on it, so the row, not the file, is refused."""
    for column in dict.fromkeys(c for c in fields.values() if c):
        for text in _strings(row.get(column)):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                return Drop(BAD_TEXT, f"field {column!r}: {e.reason} at character {e.start}")
    return None


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def with_system(messages: list[dict[str, Any]], system: Any) -> list[dict[str, Any]]:
    """`messages` led by a system turn holding `system` (a row's system column, as LLaMA-Factory's ShareGPT
    form and pairs' `system` carry it), unless it is empty or the conversation has a system turn of its own."""
    if not system or any(m["role"] == "system" for m in messages):
        return messages
    return [{"role": "system", "content": str(system)}, *messages]


def tool_calls_of(value: Any, n: int) -> list[dict[str, Any]] | Drop:
    """OpenAI `tool_calls` (or a ShareGPT call: JSON text of one call or a list) -> normalised calls."""
    value = _parsed(value, BAD_MESSAGES, f"turn {n}: the tool call")
    if isinstance(value, Drop):
        return value
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, (list, tuple)) or not items:
        return Drop(BAD_MESSAGES, f"turn {n}: expected one tool call or a list of them")
    calls = []
    for item in items:
        fn = item.get("function", item) if isinstance(item, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            return Drop(BAD_MESSAGES, f"turn {n}: a tool call without a function name")
        assert isinstance(fn, dict) and isinstance(item, dict)
        args = _parsed(fn.get("arguments", fn.get("parameters")), BAD_MESSAGES, f"turn {n}: the arguments of {name!r}")
        if isinstance(args, Drop):
            return args
        if not isinstance(args, dict) and args is not None:
            return Drop(BAD_MESSAGES, f"turn {n}: the arguments of {name!r} are not an object")
        call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args or {}}}
        if item.get("id") is not None:
            call["id"] = item["id"]
        calls.append(call)
    return calls


def tools_of(value: Any) -> list[dict[str, Any]] | None | Drop:
    """A row's `tools` column (a list of function schemas, or its JSON text) -> the template's `tools`;
    a bare `{name, description, parameters}` is wrapped as OpenAI's `{"type": "function", "function": ...}`."""
    value = _parsed(value, BAD_TOOLS, "the tools")
    if value is None or isinstance(value, Drop):
        return value
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(t, dict) for t in items):
        return Drop(BAD_TOOLS, "expected a list of function schemas")
    tools = list(items)
    return [t if "function" in t else {"type": "function", "function": t} for t in tools] or None


def _parsed(value: Any, reason: str, what: str) -> Any:
    """`value`, or the JSON its text holds (empty text: None); a Drop naming `what` when it is not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value) if value.strip() else None
    except json.JSONDecodeError as e:
        return Drop(reason, f"{what} is not JSON ({e.msg})")
