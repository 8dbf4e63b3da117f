"""Preference pairs: a row -> (prompt, chosen, rejected) -> two labelled token sequences, one row of the
tokenised dataset holding both (chosen first), so packing keeps a pair together.

What a row may look like (TRL's preference formats, read as TRL reads them):
- explicit prompt: `prompt`, `chosen`, `rejected`, each a string or a list of messages (the answers'
  messages are what is trained; a string answer is one assistant message, a string prompt one user
  message);
- implicit prompt: `chosen` and `rejected` are whole conversations; the prompt is the turns they share
  (TRL's `extract_prompt`), as in HuggingFaceH4/ultrafeedback_binarized, whose `prompt` column then only
  repeats the first user turn and is not read;
- field-mapped columns such as Intel/orca_dpo_pairs' `system`/`question`/`chosen`/`rejected`
  (`data.prompt_field: question`; `format: auto` reads a `question` column as the prompt and says so).
A `tools` column (function schemas, read as the conversational SFT formats read it) is rendered by the
template's tools header in front of both answers, as TRL's DPOTrainer renders it.

Each sequence is rendered and labelled by the SFT pipeline (`Tokenize.encode`: the model's chat template,
trained tokens = the answer after the prompt's generation prompt and its end of turn, one rendering of
the whole conversation, so templates that rewrite earlier turns are handled). Raw strings without a
chat template are tokenised as TRL's "standard" form: the prompt, then the answer and EOS (trained).

What must stay true for the loss (trainer/model/preference.py): both sequences condition on the same
prompt. A template that renders the prompt differently in front of the two answers (so the tokens
before the first trained one differ) drops the pair as `prompt_differs`, counted like every other drop.
A pair must fit one packed row (data.seq_len): `overlong: drop` drops it; `truncate` cuts the longer
answer(s) from the end so that both fit, each keeping at least half the row.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from trainer.data import formats
from trainer.data.chat_templates import require_template
from trainer.data.read import DataError, unpacked
from trainer.data.template import (
    IGNORE_INDEX,
    NO_TRAINABLE,
    NO_TRAINABLE_AFTER_TRUNCATION,
    NULL_FIELD,
    OVERLONG,
    Tokenize,
    tokenize_for,
)
from trainer.data.turns import Drop, bad_text, messages_of, tools_of, with_system

FORMAT = "preference"
WHAT = "preference (chosen/rejected pairs, with a prompt column or sharing their prompt)"
PROMPT_DIFFERS = "prompt_differs"
"""Drop reason: the template renders the prompt differently before the chosen and the rejected answer."""
NO_SHARED_PROMPT = "no_shared_prompt"
"""Drop reason: implicit-prompt conversations that share no turn, or whose answers are not assistant turns."""
EMPTY_ANSWER = "empty_answer"
"""Drop reason: an answer holds no text (nothing to score; under some templates only its end of turn)."""
IDENTICAL = "identical_answers"
"""Drop reason: the chosen and the rejected answer are the same (a pair that teaches nothing, counted wrong in
reward accuracy)."""
QUESTION = "question"
"""The prompt column `format: auto` falls back to (Intel/orca_dpo_pairs and its kind)."""
HUMAN, ASSISTANT = "\n\nHuman:", "\n\nAssistant:"
"""Anthropic/hh-rlhf's speaker markers: whole dialogues as chosen/rejected strings, no prompt column."""
_SPEAKER = re.compile(r"\n\n(Human|Assistant):")

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Pair:
    """One row as a pair: a conversation prompt and two answers (message lists), or raw strings."""

    prompt: Messages | str
    chosen: Messages | str
    rejected: Messages | str
    tools: Messages | None = None
    """Function schemas both sequences are rendered with (the template's tools header, as TRL renders them)."""


def detect(columns: list[str], head: list[dict[str, Any]], fields: dict[str, str]) -> tuple[dict[str, str], str]:
    """The roles' columns and why, for rows with `columns` (`format: auto` or `preference`); DataError
    naming the keys to set when no chosen/rejected columns are there, or when string answers come with
    no prompt column beside text columns that nothing would read (the prompt is likely in one of them).

    Where the prompt comes from, in order: the answers are whole conversations (the turns they share);
    `prompt`; LLaMA-Factory's sharegpt form (`conversations` beside answers that are one message each);
    an alpaca form (`instruction` and an optional `input`: LLaMA-Factory's alpaca files); `question`
    (Intel/orca_dpo_pairs); `input` (argilla's orca pairs); hh-rlhf dialogues (split at their last
    shared speaker marker); else the characters both answers share, as TRL splits strings."""
    cols = set(columns)
    chosen, rejected = fields.get("chosen", "chosen"), fields.get("rejected", "rejected")
    missing = [f"data.{k}_field ({c!r})" for k, c in (("chosen", chosen), ("rejected", rejected)) if c not in cols]
    if missing:
        raise DataError(
            f"preference data needs a chosen and a rejected answer per row, but {', '.join(missing)} is not among "
            f"the fields found ({', '.join(columns) or 'none'}); set data.chosen_field / data.rejected_field to "
            "the columns that hold them"
        )
    out = {**fields, "instruction": "", "input": "", "history": "", "conversations": ""}
    first = next((r.get(chosen) for r in head if r.get(chosen) is not None), None)
    whole = isinstance(first, list) and bool(first) and isinstance(first[0], dict) and _role(first[0]) != "assistant"
    prompt = fields.get("prompt", "prompt")
    turns = next(
        (c for c in (fields.get("conversations", "conversations"), fields.get("messages", "messages")) if c in cols),
        None,
    )
    instruction, input_col = fields.get("instruction", "instruction"), fields.get("input", "input")
    if whole:
        why = f"{chosen!r} and {rejected!r} hold whole conversations: the prompt is the turns they share"
        out["prompt"] = ""
    elif prompt in cols:
        why = f"prompt {prompt!r}, answers {chosen!r} and {rejected!r}"
    elif isinstance(first, dict) and turns:
        why = f"prompt {turns!r} (turns), answers {chosen!r} and {rejected!r} one message each (LLaMA-Factory's form)"
        out["prompt"] = turns
    elif isinstance(first, dict):
        raise DataError(
            f"{chosen!r} and {rejected!r} hold one message each but no column holds the turns before them (fields "
            f"found: {', '.join(columns)}); set data.prompt_field to the column that holds the prompt"
        )
    elif instruction in cols:
        why = f"prompt {instruction!r}" + (f" + {input_col!r}" if input_col in cols else "") + " (alpaca form)"
        why += f", answers {chosen!r} and {rejected!r}"
        history = fields.get("history", "history")
        out.update(prompt="", instruction=instruction, input=input_col if input_col in cols else "")
        if history in cols:
            out["history"] = history
            why += f", earlier turns {history!r}"
    elif QUESTION in cols or input_col in cols:
        col = QUESTION if QUESTION in cols else input_col
        why = f"prompt {col!r} (no {prompt!r} column), answers {chosen!r} and {rejected!r}"
        out["prompt"] = col
    elif isinstance(first, str) and _hh(first):
        why = f"{chosen!r} and {rejected!r} are Human:/Assistant: dialogues: the prompt is the turns they share"
        out["prompt"] = ""
    else:
        read = {chosen, rejected, fields.get("system", "system"), fields.get("tools", "tools")}
        texts = [c for c in columns if c not in read and any(isinstance(r.get(c), str) for r in head)]
        if texts:
            raise DataError(
                f"{chosen!r} and {rejected!r} come with no prompt column, and {', '.join(map(repr, texts))} would go "
                "unread (the prompt is likely there); set data.prompt_field to the column that holds the prompt "
                f"(or data.instruction_field, for an instruction with an {input_col!r})"
            )
        why = (
            f"no {prompt!r} column: the prompt is the text {chosen!r} and {rejected!r} share, kept as written "
            "(TRL's split of strings; no chat template)"
        )
        out["prompt"] = ""
    for role, what in (("system", "system prompt"), ("tools", "tools")):
        if fields.get(role, role) in cols:
            why += f", {what} {fields.get(role, role)!r}"
    return out, why


def control_tokens(tokenizer: Any, template: str | None) -> tuple[str, ...]:
    """The tokenizer's special tokens that `template` writes as text (`<|im_end|>`, `[INST]`, `<end_of_turn>`,
    `<|eot_id|>`): a string holding one was rendered by a template already. A BOS or EOS the template writes
    only through its variable (`</s>`, which answers may hold as HTML) does not count."""
    if template is None:
        return ()
    special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    return tuple(sorted(t for t in special if len(t) > 1 and t in template))


def templated(texts: list[Any], control: tuple[str, ...]) -> str | None:
    """The first control token one of `texts` holds (a pre-templated row), or None."""
    return next((c for t in texts if isinstance(t, str) for c in control if c in t), None)


def to_pair(
    row: dict[str, Any], fields: dict[str, str], has_template: bool, control: tuple[str, ...] = ()
) -> Pair | Drop:
    """The pair of one row, or why it is dropped (formats.py's and this module's reasons). `control`: the
    tokenizer's control tokens, which mark strings a template rendered already (kept as written)."""
    chosen, rejected = row.get(fields["chosen"]), row.get(fields["rejected"])
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None:
            return Drop(NULL_FIELD, f"field {fields[key]!r} is missing or null")
    if isinstance(chosen, str) != isinstance(rejected, str):
        return Drop(formats.BAD_MESSAGES, "one answer is text and the other is not: both text, or both messages")
    prompt_col, instruction = fields.get("prompt") or "", fields.get("instruction") or ""
    system = row.get(fields.get("system") or "system") if fields.get("system") else None
    raw = not has_template
    if prompt_col:
        prompt = row.get(prompt_col)
        if prompt is None:
            return Drop(NULL_FIELD, f"field {prompt_col!r} is missing or null")
    elif instruction:
        if row.get(instruction) is None:
            return Drop(NULL_FIELD, f"field {instruction!r} is missing or null")
        input_text = str(row.get(fields.get("input") or "") or "") if fields.get("input") else ""
        prompt = formats.alpaca_messages(str(row[instruction]), input_text)[0]["content"]
        turns = formats.history_turns(row, fields)  # LLaMA-Factory's [[query, response], ...] before it
        if isinstance(turns, Drop):
            return turns
        if turns:
            prompt = [*turns, {"role": "user", "content": prompt}]
    else:
        if chosen == rejected:
            return Drop(IDENTICAL, "the chosen and the rejected conversation are the same")
        shared = _shared_prefix(chosen, rejected, has_template and not templated([chosen, rejected], control))
        if isinstance(shared, Drop):
            return shared
        if shared is None:
            return Drop(NO_SHARED_PROMPT, "the chosen and rejected conversations share no prompt")
        prompt, chosen, rejected, raw = *shared[:3], raw or shared[3]
    strings = isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str)
    if strings and not raw and templated([prompt, chosen, rejected, system], control):
        raw = True  # rendered by a template already: rendering it again would wrap it twice
    if strings and raw:
        assert isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str)
        return _checked(Pair(f"{system}\n\n{prompt}" if system else prompt, chosen, rejected))
    msgs, good, bad = _messages(prompt, "user"), _messages(chosen, "assistant"), _messages(rejected, "assistant")
    if isinstance(msgs, Drop) or isinstance(good, Drop) or isinstance(bad, Drop):
        return next(part for part in (msgs, good, bad) if isinstance(part, Drop))
    msgs = with_system(msgs, system)
    if not all(any(m["role"] == "assistant" for m in answer) for answer in (good, bad)):
        why = "an answer holds no assistant turn"
        return Drop(NO_SHARED_PROMPT, why) if not prompt_col else Drop(formats.BAD_MESSAGES, why)
    tools = tools_of(row.get(fields["tools"])) if fields.get("tools") else None
    return tools if isinstance(tools, Drop) else _checked(Pair(msgs, good, bad, tools))


def _checked(pair: Pair) -> Pair | Drop:
    """`pair`, or a Drop when an answer is empty or both are the same."""
    for which, answer in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        if _empty(answer):
            return Drop(EMPTY_ANSWER, f"the {which} answer holds no text")
    if pair.chosen == pair.rejected:
        return Drop(IDENTICAL, "the chosen and the rejected answer are the same")
    return pair


def _empty(answer: Messages | str) -> bool:
    if isinstance(answer, str):
        return not answer.strip()
    said = [m for m in answer if m["role"] == "assistant"]
    return all(isinstance(m.get("content"), str) and not m["content"].strip() and not m.get("tool_calls") for m in said)


def _role(message: dict[str, Any]) -> Any:
    return message.get("role", message.get("from"))


def _messages(value: Any, role: str) -> Messages | Drop:
    """A string as one message of `role`, one message (LLaMA-Factory's answers) or a list of turns as messages;
    else why the pair is dropped."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    ex = messages_of([value] if isinstance(value, dict) else value, dict(formats.SHAREGPT_ROLES))
    return ex if isinstance(ex, Drop) else list(ex.messages or [])


def _hh(text: str) -> bool:
    """Whether `text` is an hh-rlhf dialogue (what `hh_turns` reads)."""
    return hh_turns(text) is not None


def hh_turns(text: str) -> list[tuple[str, str, int]] | None:
    """An hh-rlhf dialogue as (role, content, where its speaker marker ends) per turn, split at its markers
    ("\\n\\nHuman:", "\\n\\nAssistant:"; the first may lack its blank line); None when it is not one (it
    opens with no Human: turn, or has no Assistant: turn)."""
    lead = 0 if text.startswith("\n\n") else 2
    marks = list(_SPEAKER.finditer("\n\n"[:lead] + text))
    if not marks or marks[0].start() != 0 or marks[0].group(1) != "Human":
        return None
    if not any(m.group(1) == "Assistant" for m in marks):
        return None
    out = []
    for k, m in enumerate(marks):
        stop = marks[k + 1].start() if k + 1 < len(marks) else len(text) + lead
        out.append(
            ("user" if m.group(1) == "Human" else "assistant", text[m.end() - lead : stop - lead], m.end() - lead)
        )
    return out


def _shared_prefix(chosen: Any, rejected: Any, template: bool) -> tuple[Any, Any, Any, bool] | Drop | None:
    """(prompt, chosen answer, rejected answer, raw) of an implicit prompt: the turns both conversations
    share, as TRL's `extract_prompt` splits them; hh-rlhf dialogues split into turns at their speaker
    markers (with a template: as messages; raw: at the Assistant: marker that opens the answers); other
    strings at the longest shared prefix of characters (a space before the answers stays with them) and
    kept raw, as TRL keeps them. None when nothing is shared or the split leaves no answer, a Drop when a
    conversation's turns are malformed.

    Turns are compared as the messages they render (trainer/data/turns.py), not as read: Arrow gives
    every turn of a column the keys any turn of it has, filled with None, and chosen and rejected are
    two columns, so the same user turn read from each may differ in keys that hold nothing."""
    if isinstance(chosen, str) and isinstance(rejected, str):
        a, b = hh_turns(chosen), hh_turns(rejected)
        if a is not None and b is not None:
            n = _common([t[:2] for t in a], [t[:2] for t in b])
            if n == len(a) or n == len(b) or a[n][0] != "assistant" or b[n][0] != "assistant":
                return None
            if not template:  # the dialogue as written, split right after the Assistant: that opens the answers
                return chosen[: a[n][2]], chosen[a[n][2] :], rejected[b[n][2] :], True
            turns = [{"role": r, "content": c.strip()} for r, c, _ in a[:n]]
            good, bad = ([{"role": r, "content": c.strip()} for r, c, _ in x[n:]] for x in (a, b))
            return turns, good, bad, False
        n = _common(chosen, rejected)
        if n > 0 and chosen[n - 1] == " ":
            n -= 1
        return (chosen[:n], chosen[n:], rejected[n:], True) if n > 0 else None
    if not isinstance(chosen, list) or not isinstance(rejected, list):
        return None
    chosen, rejected = _messages(chosen, "assistant"), _messages(rejected, "assistant")
    if isinstance(chosen, Drop) or isinstance(rejected, Drop):
        return chosen if isinstance(chosen, Drop) else rejected
    if chosen == rejected:
        return Drop(IDENTICAL, "the chosen and the rejected conversation are the same")
    n = _common(chosen, rejected)
    if n == 0 or n == len(chosen) or n == len(rejected):
        return None
    return chosen[:n], chosen[n:], rejected[n:], False


def _common(a: Any, b: Any) -> int:
    """Length of the longest common prefix of two sequences."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass(frozen=True)
class Lengths:
    """TRL's length settings, applied to each answer's sequence (prompt + answer) apart, in TRL's order: the
    prompt keeps its last `max_prompt_length` tokens and the answer its first `max_completion_length` (TRL
    0.x's DPOTrainer), then the sequence is cut to `max_length` by `truncation_mode` (TRL's collator)."""

    max_length: int | None = None
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"

    def cap(self, ids: list[int], labels: list[int], overlong: str) -> tuple[list[int], list[int]] | Drop:
        """One sequence as the caps leave it, or why its pair is dropped (`overlong: drop`, or nothing trained left)."""
        first = next((i for i, x in enumerate(labels) if x != IGNORE_INDEX), len(labels))
        caps = (
            ("data.max_prompt_length", self.max_prompt_length, first),
            ("data.max_completion_length", self.max_completion_length, len(ids) - first),
            ("data.max_length", self.max_length, len(ids)),
        )
        for key, cap, n in caps:
            if cap is not None and n > cap and overlong == "drop":
                return Drop(OVERLONG, f"{n} tokens, {key} is {cap}")
        if self.max_prompt_length is not None and first > self.max_prompt_length:
            ids, labels = ids[first - self.max_prompt_length :], labels[first - self.max_prompt_length :]
            first = self.max_prompt_length
        if self.max_completion_length is not None:
            ids, labels = ids[: first + self.max_completion_length], labels[: first + self.max_completion_length]
        if self.max_length is not None and len(ids) > self.max_length:
            keep = (
                slice(None, self.max_length) if self.truncation_mode == "keep_start" else slice(-self.max_length, None)
            )
            ids, labels = ids[keep], labels[keep]
        labels = [IGNORE_INDEX, *labels[1:]]  # the first token of a document is never trained (template.py)
        if not _trained(labels):
            return Drop(
                NO_TRAINABLE_AFTER_TRUNCATION,
                f"cut to data.max_length={self.max_length}, an answer keeps no trained token",
            )
        return ids, labels


@dataclass
class TokenizePairs:
    """Rows -> per pair the chosen sequence then the rejected one in one tokenised row, for
    `datasets.map(batched=True)`: input_ids, labels (both sequences), chosen_length, length (both, before
    truncation) and status ("" kept, else why dropped)."""

    tok: Tokenize
    """The SFT tokenizer whose `encode` renders and labels each sequence (template, EOS, first label)."""
    lengths: Lengths = dataclasses.field(default_factory=lambda: Lengths())
    """TRL's caps of each answer's sequence (data.max_length and its kin)."""

    def settle(self, columns: list[str], head: list[dict[str, Any]], tokenizer_path: str = "") -> TokenizePairs:
        fmt = formats.normalise(self.tok.fmt)
        if fmt not in ("auto", FORMAT):
            raise DataError(
                f"{self.tok.source}: data.format is {fmt!r}, but a preference objective trains on pairs; set "
                f"data.format to auto or {FORMAT} (columns chosen/rejected, optionally prompt/system)"
            )
        fields, why = detect(columns, head, self.tok.fields)
        print(f"spotune: {self.tok.source}: pairs: {why}", file=sys.stderr, flush=True)
        tok = dataclasses.replace(self.tok, fmt=FORMAT, fields=fields, reason=why)
        chosen = next((r.get(fields["chosen"]) for r in head if r.get(fields["chosen"]) is not None), None)
        listed = (fields["prompt"] and isinstance(head[0].get(fields["prompt"]), list)) or fields["history"]
        if not isinstance(chosen, str) or listed:
            require_template(tok.template, FORMAT, tokenizer_path or str(tok.source))
        texts = [r.get(c) for r in head for c in (fields["chosen"], fields["rejected"], fields["prompt"]) if c]
        mark = templated(texts, control_tokens(tok.tokenizer, tok.template))
        if mark is not None:
            print(
                f"spotune: {tok.source}: pairs: the text holds the chat template's control token {mark!r}, so it was "
                "rendered by a template already: string pairs that hold one are kept as written (not rendered again), "
                "an answer that ends with one gets no EOS",
                file=sys.stderr,
                flush=True,
            )
        tok.say_unread(columns)
        return dataclasses.replace(self, tok=tok)

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        tok = self.tok
        columns = list(batch)
        rows = [unpacked(dict(zip(columns, values, strict=True))) for values in zip(*batch.values(), strict=True)]
        template = tok.template
        drops: list[Drop | None] = [None] * (2 * len(rows))
        examples: list[formats.Example | None] = []
        control = control_tokens(tok.tokenizer, template)
        for i, row in enumerate(rows):
            pair = bad_text(row, tok.fields) or to_pair(row, tok.fields, template is not None, control)
            if isinstance(pair, Drop):
                drops[2 * i] = drops[2 * i + 1] = pair
                examples += [None, None]
            else:
                examples += [_example(pair, pair.chosen), _example(pair, pair.rejected)]
        encoded = tok.encode(examples, [r for r in rows for _ in range(2)], drops, template)
        out: dict[str, list[Any]] = {
            "input_ids": [],
            "labels": [],
            "chosen_length": [],
            "length": [],
            "status": [],
            "detail": [],
        }
        for i in range(len(rows)):
            (c_ids, c_lab), (r_ids, r_lab) = encoded[2 * i], encoded[2 * i + 1]
            drop = drops[2 * i] or drops[2 * i + 1]
            if drop is None:
                c_ids, c_lab, r_ids, r_lab, drop = self._fit(c_ids, c_lab, r_ids, r_lab)
            full = len(encoded[2 * i][0]) + len(encoded[2 * i + 1][0])
            out["length"].append(full if drop is None or drop.reason != NULL_FIELD else 0)
            if drop is not None:
                c_ids, c_lab, r_ids, r_lab = [], [], [], []
            out["input_ids"].append(c_ids + r_ids)
            out["labels"].append(c_lab + r_lab)
            out["chosen_length"].append(len(c_ids))
            out["status"].append(drop.reason if drop is not None else "")
            out["detail"].append(drop.detail if drop is not None else "")
        return out

    def _fit(
        self, c_ids: list[int], c_lab: list[int], r_ids: list[int], r_lab: list[int]
    ) -> tuple[list[int], list[int], list[int], list[int], Drop | None]:
        """Both sequences as the row takes them, or why the pair is dropped."""
        if not _trained(c_lab) or not _trained(r_lab):
            which = "chosen" if not _trained(c_lab) else "rejected"
            return c_ids, c_lab, r_ids, r_lab, Drop(NO_TRAINABLE, f"the {which} answer has no trained token")
        if _untrained_prefix(c_ids, c_lab) != _untrained_prefix(r_ids, r_lab):
            why = "the template renders the prompt differently before the chosen and the rejected answer"
            return c_ids, c_lab, r_ids, r_lab, Drop(PROMPT_DIFFERS, why)
        fitted = fit_two(
            (c_ids, c_lab),
            (r_ids, r_lab),
            self.lengths,
            self.tok.seq_len,
            self.tok.overlong,
            "both answers",
            "an answer",
        )
        if isinstance(fitted, Drop):
            return c_ids, c_lab, r_ids, r_lab, fitted
        (c_ids, c_lab), (r_ids, r_lab) = fitted
        return c_ids, c_lab, r_ids, r_lab, None


Seq = tuple[list[int], list[int]]
"""One sequence's token ids and labels."""


def fit_two(
    first: Seq, second: Seq, lengths: Lengths, seq_len: int, overlong: str, both: str, each: str
) -> tuple[Seq, Seq] | Drop:
    """Two sequences as one packed row takes them (a pair's answers, or KTO's answer and its KL sequence): each
    capped by TRL's length settings apart, then both fitted to `seq_len`, or why the unit is dropped. `both` and
    `each` name them in the reason ("both answers", "an answer")."""
    capped = [lengths.cap(ids, lab, overlong) for ids, lab in (first, second)]
    for c in capped:
        if isinstance(c, Drop):
            return c
    (a_ids, a_lab), (b_ids, b_lab) = capped  # type: ignore[misc]
    if len(a_ids) + len(b_ids) <= seq_len:
        return (a_ids, a_lab), (b_ids, b_lab)
    if overlong == "drop":
        return Drop(OVERLONG, f"{len(a_ids) + len(b_ids)} tokens for {both}, data.seq_len is {seq_len}")
    # Each keeps at least half the row; what one leaves of its half the other may use.
    keep_a = max(seq_len - len(b_ids), min(len(a_ids), (seq_len + 1) // 2))
    keep_b = seq_len - keep_a
    a_ids, a_lab, b_ids, b_lab = a_ids[:keep_a], a_lab[:keep_a], b_ids[:keep_b], b_lab[:keep_b]
    if not _trained(a_lab) or not _trained(b_lab):
        return Drop(NO_TRAINABLE_AFTER_TRUNCATION, f"cut to data.seq_len={seq_len}, {each} keeps no trained token")
    return (a_ids, a_lab), (b_ids, b_lab)


def _example(pair: Pair, answer: Messages | str) -> formats.Example:
    """One sequence to encode: the pair's prompt (never trained) and `answer` (its assistant turns
    trained), rendered with the pair's tools."""
    prompt = pair.prompt
    if isinstance(prompt, str) and isinstance(answer, str):
        return formats.Example(prompt=prompt, text=answer)
    assert isinstance(prompt, list) and isinstance(answer, list)
    return formats.Example(
        messages=prompt + answer,
        trainable=[False] * len(prompt) + [m["role"] == "assistant" for m in answer],
        tools=pair.tools,
    )


def _trained(labels: list[int]) -> bool:
    return any(x != IGNORE_INDEX for x in labels)


def _untrained_prefix(ids: list[int], labels: list[int]) -> list[int]:
    first = next((i for i, x in enumerate(labels) if x != IGNORE_INDEX), len(labels))
    return ids[:first]


def tokenize_pairs_for(cfg: Any, tokenizer: Any, source: str) -> TokenizePairs:
    """The pair tokenizer of a DataConfig's settings (prepare and `spotune inspect` build it here)."""
    lengths = Lengths(cfg.max_length, cfg.max_prompt_length, cfg.max_completion_length, cfg.truncation_mode)
    return TokenizePairs(tokenize_for(cfg, tokenizer, source), lengths)


def documents(
    offsets: np.ndarray, chosen_lengths: np.ndarray, bins: list[list[int]]
) -> tuple[np.ndarray, list[list[int]]]:
    """Tokenised pairs as packing's documents: pair k (tokens offsets[k]:offsets[k+1], its chosen
    sequence first) becomes documents 2k (chosen) and 2k+1 (rejected), and each bin of pairs a bin of
    their documents in that order, so a row lists chosen, rejected, chosen, rejected... (what
    trainer/training/batches.py reads back). Returns (document offsets, document bins)."""
    starts = offsets[:-1].astype(np.int64)
    docs = np.empty(2 * len(starts) + 1, dtype=np.int64)
    docs[0:-1:2] = starts
    docs[1::2] = starts + chosen_lengths
    docs[-1] = offsets[-1]
    return docs, [[d for k in b for d in (2 * k, 2 * k + 1)] for b in bins]
