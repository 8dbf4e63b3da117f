"""Data formats: which columns each reads, telling them apart, and turning a row into what is trained.

Every conversational format becomes one list of `{"role", "content"}` messages (tool calls and
results included, trainer/data/turns.py) plus, per message, whether it may carry labels, and the
row's `tools`; the chat template then renders it (trainer/data/masking.py).
`text` stays raw text. A string prompt/completion without any chat template stays raw too
(TRL's "standard" form: the prompt is masked, the completion and EOS are trained).
"""

from __future__ import annotations

from typing import Any

from trainer.data.read import INTERNAL
from trainer.data.turns import (
    BAD_MESSAGES,
    NULL_FIELD,
    TOOL_CALL,
    UNKNOWN_ROLE,
    Drop,
    Example,
    messages_of,
    tools_of,
    with_system,
)

__all__ = ["BAD_MESSAGES", "FORMAT_FIELDS", "NULL_FIELD", "UNKNOWN_ROLE", "Drop", "Example", "to_example"]

# The one map of data formats to the columns they read: (config key, role in Tokenize, required).
# alpaca's `input` and `system` are optional (many sets have neither), as are the conversational
# formats' and preference pairs' `tools` (function schemas, for rows that call them) and the `system`
# column beside a conversation (LLaMA-Factory's ShareGPT form: read where the turns hold no system turn);
# the rest are required.
_TOOLS = ("tools_field", "tools", False)
_SYSTEM = ("system_field", "system", False)
FORMAT_FIELDS: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "alpaca": (
        ("instruction_field", "instruction", True),
        ("input_field", "input", False),
        ("output_field", "output", True),
        _SYSTEM,
        ("history_field", "history", False),  # LLaMA-Factory's earlier turns, [[query, response], ...]
    ),
    "prompt_completion": (("prompt_field", "prompt", True), ("completion_field", "completion", True), _TOOLS),
    "messages": (("messages_field", "messages", True), _SYSTEM, _TOOLS),
    "sharegpt": (("conversations_field", "conversations", True), _SYSTEM, _TOOLS),
    "text": (("text_field", "text", True),),
    # Pairs for the preference objectives (trainer/data/pairs.py reads them): without a prompt
    # column the prompt is what chosen and rejected share.
    "preference": (
        ("prompt_field", "prompt", False),
        ("chosen_field", "chosen", True),
        ("rejected_field", "rejected", True),
        _SYSTEM,
        _TOOLS,
        # Where pairs come without a prompt column: an alpaca form's prompt (LLaMA-Factory's alpaca files),
        # the turns before LLaMA-Factory's one-message answers.
        ("instruction_field", "instruction", False),
        ("input_field", "input", False),
        ("history_field", "history", False),
        ("conversations_field", "conversations", False),
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
SHAREGPT_ROLES |= {"tool": "tool", "function_call": TOOL_CALL, "observation": "tool"}
"""ShareGPT speaker -> chat role (data.sharegpt_roles adds to or overrides it); `tool_call` is an
assistant turn whose value is a call (turns.py)."""


def normalise(fmt: str) -> str:
    return "messages" if fmt == "chat" else fmt


def fields_of(fmt: str, cfg: Any) -> dict[str, str]:
    """Role -> column name for `fmt`, read from a DataConfig."""
    return {role: getattr(cfg, key) for key, role, _ in FORMAT_FIELDS[fmt]}


def fields_default() -> dict[str, str]:
    """Role -> the column each role is read from by default (its config key without `_field`)."""
    return {role: role for key, role, _ in FORMAT_FIELDS["auto"]}


def unread(fmt: str, columns: list[str], fields: dict[str, str]) -> str | None:
    """A line naming the data columns no role of `fmt` reads (their content does not train), or None: a
    misnamed column (alpaca-style pairs' instruction/input beside chosen/rejected) shows before the run."""
    read = {fields.get(role) for _, role, _ in FORMAT_FIELDS[normalise(fmt)]}
    left = [c for c in columns if c not in read and not c.startswith(INTERNAL)]
    if not left:
        return None
    return (
        f"format {normalise(fmt)} reads no column {', '.join(map(repr, left))} (only "
        f"{', '.join(repr(c) for c in columns if c in read)}); set the data.*_field key of a role to read one"
    )


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
) -> Example | Drop:
    """The example of one row, or why it is dropped."""
    fmt = normalise(fmt)
    if fmt == "text":
        text = row.get(fields["text"])
        return _missing(fields["text"]) if text is None else Example(text=str(text))
    if fmt == "alpaca":
        return _alpaca(row, fields)
    if fmt == "prompt_completion":
        ex = _prompt_completion(row, fields, has_template)
    else:
        key = "messages" if fmt == "messages" else "conversations"
        turns = row.get(fields[key])
        ex = _missing(fields[key]) if turns is None else messages_of(turns, roles if fmt == "sharegpt" else None)
        if not isinstance(ex, Drop) and ex.messages is not None and ex.trainable is not None and "system" in fields:
            msgs = with_system(ex.messages, row.get(fields["system"]))
            ex = Example(messages=msgs, trainable=[False] * (len(msgs) - len(ex.messages)) + ex.trainable)
    if isinstance(ex, Drop) or ex.messages is None:
        return ex
    tools = tools_of(row.get(fields["tools"])) if "tools" in fields else None
    return tools if isinstance(tools, Drop) else Example(messages=ex.messages, trainable=ex.trainable, tools=tools)


def _missing(column: str) -> Drop:
    return Drop(NULL_FIELD, f"field {column!r} is missing or null")


def alpaca_messages(instruction: str, input_text: str = "", system: str | None = None) -> list[dict[str, str]]:
    """alpaca -> [system?, user, assistant-to-come]: the input follows the instruction after a blank line.

    The demo asks its held-out questions through this too, so they are posed as trained."""
    user = f"{instruction}\n\n{input_text}" if input_text.strip() else instruction
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def history_turns(row: dict[str, Any], fields: dict[str, str]) -> list[dict[str, str]] | Drop:
    """LLaMA-Factory's alpaca `history`, [[query, response], ...]: the turns before the instruction, as
    user/assistant messages; [] where the column is absent, null or empty."""
    column = fields.get("history")
    history = row.get(column) if column else None
    if not history:
        return []
    if not isinstance(history, list) or not all(
        isinstance(t, (list, tuple)) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in history
    ):
        return Drop(BAD_MESSAGES, f"field {column!r} is not a list of [query, response]")
    return [{"role": r, "content": x} for q, a in history for r, x in (("user", q), ("assistant", a))]


def _alpaca(row: dict[str, Any], fields: dict[str, str]) -> Example | Drop:
    for role in ("instruction", "output"):
        if row.get(fields[role]) is None:
            return _missing(fields[role])
    # `input`, `system` and `history` are optional: missing, null or empty, the prompt has none.
    system = row.get(fields.get("system", "system"))
    instruction, input_text = str(row[fields["instruction"]]), str(row.get(fields["input"]) or "")
    earlier = history_turns(row, fields)
    if isinstance(earlier, Drop):
        return earlier
    msgs = alpaca_messages(instruction, input_text, str(system) if system else None)
    msgs[-1:-1] = earlier  # after the system turn, before the instruction
    msgs.append({"role": "assistant", "content": str(row[fields["output"]])})
    # Every answer is trained, the earlier ones too: LLaMA-Factory's default (mask_history: false).
    return Example(messages=msgs, trainable=[m["role"] == "assistant" for m in msgs])


def _prompt_completion(row: dict[str, Any], fields: dict[str, str], has_template: bool) -> Example | Drop:
    prompt, completion = row.get(fields["prompt"]), row.get(fields["completion"])
    if prompt is None or completion is None:
        return _missing(fields["prompt" if prompt is None else "completion"])
    if isinstance(prompt, str) and isinstance(completion, str):
        if not has_template:
            return Example(prompt=prompt, text=completion)
        prompt, completion = [{"role": "user", "content": prompt}], [{"role": "assistant", "content": completion}]
    if not isinstance(prompt, list) or not isinstance(completion, list):
        return Drop(BAD_MESSAGES, "prompt and completion must both be text or both lists of messages")
    head = messages_of(prompt, None)
    tail = messages_of(completion, None)
    if isinstance(head, Drop) or isinstance(tail, Drop):
        return head if isinstance(head, Drop) else tail
    assert head.messages is not None and tail.messages is not None and tail.trainable is not None
    # Only the completion is trained (TRL's rule): an assistant turn inside the prompt is context.
    return Example(messages=head.messages + tail.messages, trainable=[False] * len(head.messages) + tail.trainable)
