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


def assistant_turns(
    render: Render,
    messages: list[dict[str, Any]],
    gen_prompt: str,
    special: Sequence[str],
    end_of_turn: str | None = None,
) -> tuple[str, list[Turn]]:
    """The rendered conversation and, per assistant message in order, where its turn lies."""
    full = render(messages, False)
    idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not idx:
        return full, []
    marked = [dict(m, content=SENTINEL.format(idx.index(i))) if i in idx else m for i, m in enumerate(messages)]
    skeleton = render(marked, False)
    pieces, pos = [], 0
    for k in range(len(idx)):
        at = skeleton.find(SENTINEL.format(k), pos)
        if at < 0:
            raise TemplateShapeError(f"the template does not render assistant message {idx[k] + 1} as given")
        pieces.append(skeleton[pos:at])
        pos = at + len(SENTINEL.format(k))
    pieces.append(skeleton[pos:])

    def prompt_part(piece: str) -> str:
        cut = piece.rfind(gen_prompt) if gen_prompt else -1
        return piece if cut < 0 else piece[: cut + len(gen_prompt)]

    turns: list[Turn] = []
    cursor = 0
    for k in range(len(idx)):
        head = prompt_part(pieces[k])
        if not full.startswith(head, cursor):
            raise TemplateShapeError(f"the template renders the text before assistant message {idx[k] + 1} differently")
        start = cursor + len(head)
        last = k + 1 == len(idx)
        nxt = pieces[k + 1] if last else prompt_part(pieces[k + 1])
        end = len(full) - len(nxt) if last and full.endswith(nxt) else (-1 if last else full.find(nxt, start))
        if end < start:
            raise TemplateShapeError(f"the template renders the text after assistant message {idx[k] + 1} differently")
        turns.append(_with_stop(full, start, end, special, end_of_turn))
        cursor = end
    return full, turns


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
