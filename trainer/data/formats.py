"""Data formats: which columns each reads, telling them apart, and turning a row into what is trained.

Every conversational format becomes one list of `{"role", "content"}` messages plus, per
message, whether it may carry labels; the chat template then renders it (trainer/data/masking.py).
`text` stays raw text. A string prompt/completion without any chat template stays raw too
(TRL's "standard" form: the prompt is masked, the completion and EOS are trained).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The one map of data formats to the columns they read: (config key, role in Tokenize, required).
# alpaca's `input` and `system` are optional (many sets have neither); the rest are required.
FORMAT_FIELDS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "alpaca": (
        ("instruction_field", "instruction", True),
        ("input_field", "input", False),
        ("output_field", "output", True),
        ("system_field", "system", False),
    ),
    "prompt_completion": (("prompt_field", "prompt", True), ("completion_field", "completion", True)),
    "messages": (("messages_field", "messages", True),),
    "sharegpt": (("conversations_field", "conversations", True),),
    "text": (("text_field", "text", True),),
    # Pairs for the preference objectives (trainer/data/pairs.py reads them): without a prompt
    # column the prompt is what chosen and rejected share.
    "preference": (
        ("prompt_field", "prompt", False),
        ("chosen_field", "chosen", True),
        ("rejected_field", "rejected", True),
        ("system_field", "system", False),
    ),
}
FORMAT_FIELDS["chat"] = FORMAT_FIELDS["messages"]  # the earlier name of `messages`, still accepted
FORMAT_FIELDS["auto"] = tuple(dict.fromkeys(f for fmt in FORMAT_FIELDS.values() for f in fmt))

WHAT = {
    "sharegpt": "sharegpt (conversations of from/value)",
    "messages": "messages (a list of role/content)",
    "prompt_completion": "prompt_completion (prompt + completion)",
    "alpaca": "alpaca (instruction/input/output)",
    "text": "text (raw text, every token trained)",
}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
SHAREGPT_ROLES |= {"tool": "tool", "function_call": "assistant", "observation": "tool"}
"""ShareGPT speaker -> chat role (data.sharegpt_roles adds to or overrides it)."""

# Drop reasons a row can get here (the rest live in template.py).
NULL_FIELD = "null_field"
UNKNOWN_ROLE = "unknown_role"
BAD_MESSAGES = "malformed_messages"


@dataclass(frozen=True)
class Example:
    """One row, ready to render: a conversation, raw text, or a raw prompt + completion."""

    messages: list[dict[str, Any]] | None = None
    trainable: list[bool] | None = None  # per message: may it carry labels (only assistant ones ever do)
    text: str | None = None
    prompt: str | None = None  # raw prompt/completion (no chat template anywhere)


def normalise(fmt: str) -> str:
    return "messages" if fmt == "chat" else fmt


def fields_of(fmt: str, cfg: Any) -> dict[str, str]:
    """Role -> column name for `fmt`, read from a DataConfig."""
    return {role: getattr(cfg, key) for key, role, _ in FORMAT_FIELDS[fmt]}


def fields_default() -> dict[str, str]:
    """Role -> the column each role is read from by default (its config key without `_field`)."""
    return {role: role for key, role, _ in FORMAT_FIELDS["auto"]}


def required(fmt: str, fields: dict[str, str]) -> dict[str, str]:
    """Config key -> column name of the columns `fmt` cannot do without."""
    return {key: fields[role] for key, role, req in FORMAT_FIELDS[normalise(fmt)] if req}


def detect(columns: list[str], head: list[dict[str, Any]], fields: dict[str, str]) -> tuple[str | None, str]:
    """(format, why) from the column names and the first rows; (None, what was seen) when none fits."""
    cols = set(columns)
    turn_cols = (fields.get("conversations", "conversations"), fields.get("messages", "messages"))

    def first(col: str) -> Any:
        return next((r[col] for r in head if r.get(col) is not None), None)

    def turns_with(col: str, keys: tuple[str, str]) -> bool:
        value = first(col)
        return (
            isinstance(value, list)
            and bool(value)
            and all(isinstance(t, dict) and set(keys) <= t.keys() for t in value)
        )

    for col in turn_cols:
        if col in cols and turns_with(col, ("from", "value")):
            return "sharegpt", f"column {col!r} holds turns of from/value"
    for col in reversed(turn_cols):
        if col in cols and turns_with(col, ("role", "content")):
            fmt = "messages" if col == turn_cols[1] else "sharegpt"  # sharegpt reads role/content turns too
            return fmt, f"column {col!r} holds turns of role/content"
    if {fields.get("prompt", "prompt"), fields.get("completion", "completion")} <= cols:
        return (
            "prompt_completion",
            f"columns {fields.get('prompt', 'prompt')!r} and {fields.get('completion', 'completion')!r}",
        )
    if {fields.get("instruction", "instruction"), fields.get("output", "output")} <= cols:
        return "alpaca", f"columns {fields.get('instruction', 'instruction')!r} and {fields.get('output', 'output')!r}"
    if fields.get("text", "text") in cols:
        return "text", f"column {fields.get('text', 'text')!r}"
    found = f"fields found: {', '.join(columns) or 'none'}"
    if {fields.get("chosen", "chosen"), fields.get("rejected", "rejected")} <= cols:
        return None, f"{found}; they hold preference pairs: set train.objective=dpo (or orpo, simpo) to train on them"
    for fmt in WHAT:  # a format some of whose columns are there: name the one missing and its key
        need = required(fmt, {**fields_default(), **fields})
        missing = {k: c for k, c in need.items() if c not in cols}
        if missing and len(missing) < len(need):
            key, col = next(iter(missing.items()))
            return None, f"{found}; for {fmt}, field {col!r} is missing: set data.{key} to the field that holds it"
    return None, found


def turn_column(why: str) -> str | None:
    """The column `detect` found turns in (its reason names it first)."""
    return why.split("'")[1] if why.startswith("column '") else None


def settled_fields(fmt: str, why: str, fields: dict[str, str]) -> dict[str, str]:
    """`fields` with the turns read from the column `detect` found them in."""
    col = turn_column(why)
    return {**fields, "conversations": col} if fmt == "sharegpt" and col else fields


def mismatch(fmt: str, columns: list[str], head: list[dict[str, Any]], fields: dict[str, str]) -> str | None:
    """A sentence naming the format to set when rows read as `fmt` look like another one."""
    fmt = normalise(fmt)
    seen, why = detect(columns, head, fields)
    missing = [col for col in required(fmt, fields).values() if col not in columns]
    shape = fmt in ("messages", "sharegpt") and seen in ("messages", "sharegpt") and seen != fmt
    shape = shape and not (fmt == "sharegpt" and "role/content" in why)  # sharegpt reads role/content too
    if seen is None or seen == fmt or not (missing or shape):
        return None
    fix = f"data.format={seen}"
    col = turn_column(why)
    if seen == "sharegpt" and col and col != fields.get("conversations"):
        fix += f" and data.conversations_field={col}"
    return f"looks like {WHAT[seen]}: {why}; set {fix} (or data.format=auto)"


# ---------------------------------------------------------------------------- rows -> examples


def to_example(
    fmt: str, row: dict[str, Any], fields: dict[str, str], roles: dict[str, str], has_template: bool
) -> Example | str:
    """The example of one row, or the reason it is dropped."""
    fmt = normalise(fmt)
    if fmt == "text":
        text = row.get(fields["text"])
        return NULL_FIELD if text is None else Example(text=str(text))
    if fmt == "alpaca":
        return _alpaca(row, fields)
    if fmt == "prompt_completion":
        return _prompt_completion(row, fields, has_template)
    key = "messages" if fmt == "messages" else "conversations"
    turns = row.get(fields[key])
    if turns is None:
        return NULL_FIELD
    return _turns(turns, roles if fmt == "sharegpt" else None)


def alpaca_messages(instruction: str, input_text: str = "", system: str | None = None) -> list[dict[str, str]]:
    """alpaca -> [system?, user, assistant-to-come]: the input follows the instruction after a blank line.

    The demo asks its held-out questions through this too, so they are posed as trained."""
    user = f"{instruction}\n\n{input_text}" if input_text.strip() else instruction
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def _alpaca(row: dict[str, Any], fields: dict[str, str]) -> Example | str:
    instruction, output = row.get(fields["instruction"]), row.get(fields["output"])
    if instruction is None or output is None:
        return NULL_FIELD
    system = row.get(fields.get("system", "system"))
    msgs = alpaca_messages(str(instruction), str(row.get(fields["input"]) or ""), str(system) if system else None)
    msgs.append({"role": "assistant", "content": str(output)})
    return Example(messages=msgs, trainable=[m["role"] == "assistant" for m in msgs])


def _prompt_completion(row: dict[str, Any], fields: dict[str, str], has_template: bool) -> Example | str:
    prompt, completion = row.get(fields["prompt"]), row.get(fields["completion"])
    if prompt is None or completion is None:
        return NULL_FIELD
    if isinstance(prompt, str) and isinstance(completion, str):
        if not has_template:
            return Example(prompt=prompt, text=completion)
        prompt, completion = [{"role": "user", "content": prompt}], [{"role": "assistant", "content": completion}]
    if not isinstance(prompt, list) or not isinstance(completion, list):
        return BAD_MESSAGES
    head = _turns(prompt, None)
    tail = _turns(completion, None)
    if isinstance(head, str) or isinstance(tail, str):
        return head if isinstance(head, str) else str(tail)
    assert head.messages is not None and tail.messages is not None and tail.trainable is not None
    # Only the completion is trained (TRL's rule): an assistant turn inside the prompt is context.
    return Example(messages=head.messages + tail.messages, trainable=[False] * len(head.messages) + tail.trainable)


def _turns(turns: Any, roles: dict[str, str] | None) -> Example | str:
    """role/content (or, for sharegpt, from/value) turns -> messages; `weight: 0` marks a turn untrained."""
    if not isinstance(turns, (list, tuple)):
        return BAD_MESSAGES
    msgs: list[dict[str, Any]] = []
    trainable: list[bool] = []
    for t in turns:
        if not isinstance(t, dict):
            return BAD_MESSAGES
        # Arrow stores a list of structs with the union of keys; drop the None-filled extras.
        t = {k: v for k, v in t.items() if v is not None}
        role, content = (t.get("from"), t.get("value")) if "from" in t else (t.get("role"), t.get("content"))
        if role is None or content is None:
            return NULL_FIELD if ("from" in t or "role" in t) else BAD_MESSAGES
        if roles is not None:
            if role not in roles:
                return UNKNOWN_ROLE
            role = roles[role]
        msg = {k: v for k, v in t.items() if k not in ("from", "value", "weight")}
        msg.update(role=role, content=content)
        msgs.append(msg)
        trainable.append(role == "assistant" and t.get("weight", 1) not in (0, False))
    return Example(messages=msgs, trainable=trainable)
