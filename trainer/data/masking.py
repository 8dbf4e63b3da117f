"""Which characters of a rendered conversation are the assistant's: found in ONE rendering of the whole.

Real chat templates rewrite earlier turns once later ones arrive (Qwen3 strips `<think>` from all
but the last assistant turn; Llama 3.1 adds a date header; Gemma folds the system prompt into the
first user turn; Mistral v0.3 moves it into the last [INST]), so rendering prefixes and diffing
them (the former method) fails. Instead:

1. render the conversation with every assistant content replaced by a unique sentinel: the text
   between sentinels is the template's own (headers, user and system turns, end-of-turn marks);
2. in each such piece, the text up to the last generation prompt (what `add_generation_prompt`
   appends, e.g. `<|im_start|>assistant\\n`) is prompt; what follows it is already the model's
   (Qwen3's `<think>` block);
3. render the real conversation once, and walk it: each prompt piece must appear verbatim, in
   order; what lies between two of them is an assistant turn, as the template rendered it;
4. the special token the template puts right after a turn (`<|eot_id|>`, `<|im_end|>`,
   `<end_of_turn>`, `</s>`) is the turn's end, and trained with it: it is how the model stops.

An assistant message that calls tools is the model's from its start (step 2) to the template's
end-of-turn mark after the calls: the calls are written by the template around their names and
arguments (`<tool_call>\n{"name": ...}`, Llama 3.1's bare JSON, Mistral's `[TOOL_CALLS] [...]`), and
the model must write all of it. Its sentinel is the first call's name, which every tool-rendering
template writes (Llama 3.1 drops the content of such a message); where the template writes no
generation prompt (Mistral), the text it writes before that name (`Shape.call_lead`) is the model's.

A template that drops or reorders assistant content fails step 1 or 3 with a message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SENTINEL = "\ue000spotune-assistant-{}\ue001"  # private-use characters: no template or text contains them

Render = Callable[[list[dict[str, Any]], bool], str]


class TemplateShapeError(ValueError):
    """The template does not render assistant turns as contiguous text in order."""


@dataclass(frozen=True)
class Shape:
    """What a template writes around turns, probed once per template (`shape`)."""

    gen_prompt: str
    """What `add_generation_prompt` appends (may be empty, as in Mistral's)."""
    special: tuple[str, ...]
    """The tokenizer's special tokens: one of them right after a turn is its end."""
    end_of_turn: str | None = None
    """A named template's end-of-turn text, for tokenizers that lack it as one special token."""
    stop: str | None = None
    """The end-of-turn mark after an assistant turn ("" or None: the template writes none)."""
    call_lead: str | None = None
    """What the template writes between the served prompt and a first tool call's name; None: it renders no tool calls."""


@dataclass(frozen=True)
class Turn:
    start: int  # first character of the assistant turn in the rendered text
    end: int  # one past its last character
    stop_end: int  # one past its end-of-turn mark (== end when the template writes none)
    stop_is_token: bool  # the end-of-turn mark is one special token (generation stops there)


def generation_prompt(render: Render) -> str:
    """What the template appends for `add_generation_prompt` (may be empty, as in Mistral's)."""
    probe = [{"role": "user", "content": "ping"}]
    bare, primed = render(probe, False), render(probe, True)
    return primed[len(bare) :] if primed.startswith(bare) else ""


def shape(render: Render, special: Sequence[str], end_of_turn: str | None = None) -> Shape:
    """The template's `Shape`, from a few probe conversations."""
    from jinja2 import TemplateError

    gen = generation_prompt(render)
    ping, pong = {"role": "user", "content": "ping"}, "spotune-probe-answer"
    probe = render([ping, {"role": "assistant", "content": pong}], False)
    after = probe.find(pong) + len(pong)
    stop = _with_stop(probe, after, after, special, end_of_turn)
    name = SENTINEL.format("call")
    call = {"id": "spotune00", "type": "function", "function": {"name": name, "arguments": {}}}  # Mistral: 9-char ids
    try:
        called = render([ping, {"role": "assistant", "content": "", "tool_calls": [call]}], False)
        served = render([ping], True)
    except TemplateError:  # a template that refuses tool calls
        called, served = "", ""
    at = called.find(name)
    lead = called[len(served) : at] if at >= 0 and called.startswith(served) else None
    return Shape(gen, tuple(special), end_of_turn, probe[stop.end : stop.stop_end] or None, lead)


def system_served_late(render: Render) -> bool:
    """Whether the template leaves the system prompt out of a conversation that ends with the
    assistant yet writes it for the served prompt, joined to the user turn with a blank line (Mistral
    v0.3 writes it into the last `[INST]` only, so a training row would never see it). A property of
    the template: probed once, like `generation_prompt`."""
    system, user, answer = (
        {"role": "system", "content": "spotune-probe-system"},
        {"role": "user", "content": "ping"},
        {"role": "assistant", "content": "pong"},
    )
    if system["content"] in render([system, user, answer], False):
        return False
    served = render([system, user], True)
    folded = dict(user, content=f"{system['content']}\n\n{user['content']}")
    return system["content"] in served and render([folded], True) == served


def system_as_served(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """For a template that serves the system prompt late (`system_served_late`): the conversation with
    its system text joined to the last user turn before the last assistant one, where a chat endpoint
    puts it, so the final turn trains on what is served (earlier turns keep their own context); None
    when there is no system text or no such user turn."""
    system = [str(m["content"]) for m in messages if m["role"] == "system" and m.get("content")]
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    users = [i for i in range(answers[-1]) if messages[i]["role"] == "user"] if answers else []
    if not system or not users:
        return None
    joined = "\n\n".join(system)
    return [
        dict(m, content=f"{joined}\n\n{m['content']}") if i == users[-1] else m
        for i, m in enumerate(messages)
        if m["role"] != "system"
    ]


def assistant_turns(render: Render, messages: list[dict[str, Any]], shape: Shape) -> tuple[str, list[Turn]]:
    """The rendered conversation and, per assistant message in order, where its turn lies."""
    full = render(messages, False)
    idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not idx:
        return full, []
    calls = [bool(messages[i].get("tool_calls")) for i in idx]
    if any(calls) and shape.call_lead is None:
        raise TemplateShapeError("the chat template does not render tool calls")
    marked = list(messages)
    for k, i in enumerate(idx):
        marked[i] = _marked(messages[i], SENTINEL.format(k), calls[k])
    skeleton = render(marked, False)
    pieces, pos = [], 0
    for k in range(len(idx)):
        at = skeleton.find(SENTINEL.format(k), pos)
        if at < 0:
            raise TemplateShapeError(f"the template does not render assistant message {idx[k] + 1} as given")
        pieces.append(skeleton[pos:at])
        pos = at + len(SENTINEL.format(k))
    pieces.append(skeleton[pos:])

    def prompt_part(piece: str, call: bool = False) -> str:
        if call and not shape.gen_prompt and shape.call_lead and piece.endswith(shape.call_lead):
            return piece[: len(piece) - len(shape.call_lead)]  # Mistral's `[TOOL_CALLS] [{"name": "` is the model's
        cut = piece.rfind(shape.gen_prompt) if shape.gen_prompt else -1
        return piece if cut < 0 else piece[: cut + len(shape.gen_prompt)]

    turns: list[Turn] = []
    cursor = 0
    for k in range(len(idx)):
        head = prompt_part(pieces[k], calls[k])
        if not full.startswith(head, cursor):
            raise TemplateShapeError(f"the template renders the text before assistant message {idx[k] + 1} differently")
        start = cursor + len(head)
        last = k + 1 == len(idx)
        nxt = pieces[k + 1] if last else prompt_part(pieces[k + 1], calls[k + 1])
        end = len(full) - len(nxt) if last and full.endswith(nxt) else (-1 if last else full.find(nxt, start))
        if end < start:
            raise TemplateShapeError(f"the template renders the text after assistant message {idx[k] + 1} differently")
        turns.append(
            _call_turn(full, start, end, end + len(nxt), shape)
            if calls[k]
            else _with_stop(full, start, end, shape.special, shape.end_of_turn)
        )
        cursor = end
    return full, turns


def _marked(message: dict[str, Any], sentinel: str, call: bool) -> dict[str, Any]:
    """The message with its sentinel: as its content, or as its first tool call's name."""
    if not call:
        return dict(message, content=sentinel)
    first, *rest = message["tool_calls"]
    fn = dict(first["function"], name=sentinel)
    return dict(message, tool_calls=[dict(first, function=fn), *rest])


def _call_turn(full: str, start: int, after_name: int, limit: int, shape: Shape) -> Turn:
    """A tool-calling turn: from `start` through the end-of-turn mark the template writes after its calls."""
    at = full.find(shape.stop, after_name, limit) if shape.stop else -1
    if at < 0:
        raise TemplateShapeError(
            "the template writes no end-of-turn mark after a tool call, so its end cannot be found"
        )
    assert shape.stop is not None
    return Turn(start, at, at + len(shape.stop), shape.stop in shape.special)


def _with_stop(full: str, start: int, end: int, special: Sequence[str], end_of_turn: str | None) -> Turn:
    """The turn plus the end-of-turn mark right after it: the longest special token there, else the
    named template's mark (several plain tokens on a base model's tokenizer), else nothing."""
    token = max((s for s in special if s and full.startswith(s, end)), key=len, default=None)
    if token is not None:
        return Turn(start, end, end + len(token), True)
    if end_of_turn and full.startswith(end_of_turn, end):
        return Turn(start, end, end + len(end_of_turn), False)
    return Turn(start, end, end, False)


def label_tokens(
    ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]], ignore: int
) -> list[int]:
    """Labels: a token is trained when its characters overlap a span (a token that straddles a
    header and the content, as SentencePiece's `▁word` after `[/INST]` does, is the model's to write)."""
    labels = []
    for t, (s, e) in zip(ids, offsets, strict=True):
        hit = e > s and any(s < b and e > a for a, b in spans)
        labels.append(t if hit else ignore)
    return labels
