"""Templates: raw rows -> token ids + labels, only the assistant's text (and its end of turn) trained.

Label convention (shared with pack.py and the loss): labels are aligned with input_ids,
-100 means "no loss here", and the loss shifts (logits[:, :-1] predict labels[:, 1:]).
Therefore the first token of every document always carries -100: in a packed row it
would otherwise be predicted from the previous document's last token.

Every conversational format (alpaca, prompt/completion, messages, sharegpt; trainer/data/formats.py)
is rendered by the chat template that `final/` will carry (trainer/data/chat_templates.py), and the
assistant's characters are found in that one rendering (trainer/data/masking.py).

`Tokenize` is a picklable callable for `datasets.map(batched=True)`. It returns, per row, the
(possibly truncated) ids and labels, the full token length before truncation, a status: ""
(kept) or the reason the row is dropped (counted in the manifest, never dropped silently), and
the drop's detail (which field or turn; listed with the row's file and line).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.data import formats, masking
from trainer.data.chat_templates import END_OF_TURN, NAMED, dated, require_template, resolve_chat_template
from trainer.data.formats import Drop
from trainer.data.read import DataError, unpacked
from trainer.data.turns import bad_text

IGNORE_INDEX = -100
"""The label that carries no loss (PyTorch's cross_entropy default ignore_index); defined once here."""

ROW_COLUMN = "__spotune_row"
ANSWERS_CUT = "answers_cut"
"""The column of what seq_len costs an example's answers: [trained tokens, of them cut, answers (trained
spans), of them cut before their end of turn], before the length policy (`answers_cut`)."""

# Drop reasons, as they appear in the manifest and the summary (turns.py adds null_field,
# unknown_role, malformed_messages and malformed_tools).
OVERLONG = "overlong"
NO_TRAINABLE = "no_trainable_tokens"
NO_TRAINABLE_AFTER_TRUNCATION = "no_trainable_after_truncation"
NULL_FIELD = formats.NULL_FIELD
TEMPLATE_ERROR = "template_error"
HEAD_ROWS = 20
"""Rows `format: auto` and the format checks look at."""

# ids, labels, and whether an appended EOS is trained (None: append none, the template ends turns itself)
Pair = tuple[list[int], list[int], bool | None]


@dataclass
class Tokenize:
    fmt: str  # a key of formats.FORMAT_FIELDS; `auto` is settled by `settle` before the first call
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    fields: dict[str, str]  # role -> column name (formats.FORMAT_FIELDS)
    seq_len: int
    overlong: Literal["truncate", "drop"]
    chat_template: str | None = None  # the data.chat_template setting: unset, a name of NAMED, or Jinja
    source: str = "data"
    roles: dict[str, str] = field(default_factory=lambda: dict(formats.SHAREGPT_ROLES))
    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    train_on_inputs: bool = False
    reason: str = ""  # why `auto` chose fmt
    template_date: str | None = None  # YYYY-MM-DD a template's strftime_now writes (data.template_date)

    def settle(self, columns: list[str], head: list[dict[str, Any]], tokenizer_path: str = "") -> Tokenize:
        """This Tokenize for data with `columns` whose first rows are `head`: `auto` resolved (and said
        so), the columns checked, a file that looks like another format named, the template required."""
        out = self
        if self.fmt == "auto":
            fmt, why = formats.detect(columns, head, self.fields)
            if fmt is None:
                raise DataError(
                    f"{self.source}: cannot tell the data format ({why}); set data.format to one of "
                    f"{', '.join(formats.WHAT)}, or the data.*_field keys to the columns that hold it."
                )
            said = f"spotune: {self.source}: data.format=auto -> {fmt} ({why})"
            if said not in _SAID_AUTO:  # once per process: `inspect --show` settles each source before prepare
                _SAID_AUTO.add(said)
                print(said, file=sys.stderr, flush=True)
            out = dataclasses.replace(self, fmt=fmt, reason=why, fields=formats.settled_fields(fmt, why, self.fields))
        fmt = formats.normalise(out.fmt)
        hint = formats.mismatch(fmt, columns, head, out.fields)
        for key, col in formats.required(fmt, out.fields).items():
            if col not in columns or hint:
                first = f"field {col!r} not found" if col not in columns else f"data.format is {fmt!r} but the file"
                raise DataError(
                    f"{self.source}: {first} (fields found: {', '.join(columns) or 'none'}); "
                    + (hint or f"set data.{key} to the field that holds it.")
                )
        if fmt in ("alpaca", "messages", "sharegpt") or _conversational_pc(fmt, head, out.fields):
            require_template(out.template, fmt, tokenizer_path or str(self.source))
        out.say_unread(columns)
        return out

    def say_unread(self, columns: list[str]) -> None:
        """Say once, on settling a source, which of its data columns its format reads none of."""
        line = formats.unread(self.fmt, columns, self.fields)
        if line:
            print(f"spotune: {self.source}: {line}", file=sys.stderr, flush=True)

    @property
    def template(self) -> str | None:
        return (
            None if formats.normalise(self.fmt) == "text" else resolve_chat_template(self.chat_template, self.tokenizer)
        )

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        columns = list(batch)
        rows = [unpacked(dict(zip(columns, values, strict=True))) for values in zip(*batch.values(), strict=True)]
        drops: list[Drop | None] = [None] * len(rows)
        template = self.template
        examples: list[formats.Example | None] = []
        for i, row in enumerate(rows):
            ex = bad_text(row, self.fields) or formats.to_example(
                self.fmt, row, self.fields, self.roles, template is not None
            )
            drops[i] = ex if isinstance(ex, Drop) else None
            examples.append(None if isinstance(ex, Drop) else ex)
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "length": [], "status": [], "detail": []}
        for (ids, labels), drop in zip(self.encode(examples, rows, drops, template), drops, strict=True):
            if drop is not None:
                self._emit(out, [], [], 0, drop)
                out.setdefault(ANSWERS_CUT, []).append([0, 0, 0, 0])  # dropped before it met seq_len
            else:
                self._finish(out, ids, labels)
        return out

    def encode(
        self,
        examples: list[formats.Example | None],
        rows: list[dict[str, Any]],
        drops: list[Drop | None],
        template: str | None,
    ) -> list[tuple[list[int], list[int]]]:
        """Each example's ids and labels before the length policy (a dropped one's are empty and its
        `drops` entry, which this may set, says why). Preference pairs encode their two sequences here too
        (trainer/data/pairs.py)."""
        out: list[tuple[list[int], list[int]]] = []
        eos = self.tokenizer.eos_token_id
        for (ids, labels, eos_trained), drop in zip(self._pairs(examples, rows, drops, template), drops, strict=True):
            if drop is not None:
                out.append(([], []))
                continue
            if eos is not None and eos_trained is not None and (not ids or ids[-1] != eos):
                # EOS teaches the model to stop: trained after raw text, a raw completion, and a
                # conversation whose template ends the last assistant turn with no special token.
                labels.append(eos if eos_trained else IGNORE_INDEX)
                ids.append(eos)
            if self.train_on_inputs:
                labels = list(ids)
            if labels:
                labels[0] = IGNORE_INDEX  # see the module docstring: no prediction across documents
            out.append((ids, labels))
        return out

    # ------------------------------------------------------------------ rendering

    def _pairs(
        self,
        examples: list[formats.Example | None],
        rows: list[dict[str, Any]],
        drops: list[Drop | None],
        template: str | None,
    ) -> list[Pair]:
        pairs: list[Pair] = [([], [], None)] * len(examples)
        texts = [
            (i, ex) for i, ex in enumerate(examples) if ex is not None and ex.messages is None and ex.prompt is None
        ]
        if texts:  # raw text: every token trained (the first is masked later)
            for (i, _), ids in zip(texts, self.tokenizer([ex.text or "" for _, ex in texts])["input_ids"], strict=True):
                pairs[i] = (list(ids), list(ids), True)
        raw = [(i, ex) for i, ex in enumerate(examples) if ex is not None and ex.prompt is not None]
        if raw:  # a raw prompt (masked) and its completion, tokenised apart so the boundary is exact
            prompts = self.tokenizer([ex.prompt or "" for _, ex in raw], add_special_tokens=True)["input_ids"]
            bodies = self.tokenizer([ex.text or "" for _, ex in raw], add_special_tokens=False)["input_ids"]
            bos, ends = self.tokenizer.bos_token_id, self._special_texts()
            for (i, ex), p, b in zip(raw, prompts, bodies, strict=True):
                p = list(p[1:]) if bos is not None and len(p) > 1 and p[0] == p[1] == bos else list(p)  # BOS written in
                # A completion that ends with a control token (one a template wrote: `<|im_end|>`) is given no EOS.
                closed = (ex.text or "").rstrip().endswith(ends) if ends else False
                pairs[i] = (p + list(b), [IGNORE_INDEX] * len(p) + list(b), None if closed else True)
        chats = [(i, ex) for i, ex in enumerate(examples) if ex is not None and ex.messages is not None]
        if chats:
            assert template is not None  # settle() required one for every conversational format
            for i, pair in self._chat(chats, rows, drops, template):
                pairs[i] = pair
        return pairs

    def _special_texts(self) -> tuple[str, ...]:
        """The tokenizer's special tokens as text (those that stop generation where a template writes them)."""
        return tuple(
            t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special and len(t.content) > 1
        )

    def renderer(self, template: str, tools: list[dict[str, Any]] | None = None) -> masking.Render:
        """messages, add_generation_prompt -> the text `template` renders (with the conversation's
        `tools`, and the run's date where the template writes today's)."""
        text = dated(template, self.template_date)

        def render(msgs: list[dict[str, Any]], gen: bool) -> str:
            return str(
                self.tokenizer.apply_chat_template(
                    msgs, chat_template=text, tools=tools, tokenize=False, add_generation_prompt=gen
                )
            )

        return render

    def _chat(
        self,
        chats: list[tuple[int, formats.Example]],
        rows: list[dict[str, Any]],
        drops: list[Drop | None],
        template: str,
    ) -> list[tuple[int, Pair]]:
        from jinja2 import TemplateError

        render = self.renderer(template)
        special = sorted({t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special})
        end_of_turn = END_OF_TURN.get(self.chat_template or "") if self.chat_template in NAMED else None
        shape = masking.shape(render, special, end_of_turn)
        try:
            late_system = masking.system_served_late(render)
        except TemplateError:  # a template that refuses system turns: nothing is served late
            late_system = False
        kept: list[tuple[int, str, list[tuple[int, int]], bool | None]] = []
        for i, ex in chats:
            assert ex.messages is not None and ex.trainable is not None
            try:
                if late_system:
                    ex = _system_as_served(ex)
                assert ex.messages is not None
                text, turns = masking.assistant_turns(self.renderer(template, ex.tools), ex.messages, shape)
            except masking.TemplateShapeError as e:
                if shape.call_lead is None and any(m.get("tool_calls") for m in ex.messages or ()):
                    drops[i] = Drop(TEMPLATE_ERROR, str(e))  # a template without tool calls: these rows cannot train
                    continue
                row = rows[i].get(ROW_COLUMN, i)
                raise DataError(
                    f"{self.source}: row {int(row) + 1}: {e}, so its tokens cannot be labelled; "
                    "use a template that writes each assistant message's content as it is (data.chat_template)."
                ) from None
            except Exception as e:  # noqa: BLE001 - the template refuses this row: roles that do not alternate
                # (its TemplateError), a value of a type it cannot concatenate (TypeError)... one row's drop, never a crash
                first = str(e).splitlines()[0] if str(e) else ""
                drops[i] = Drop(
                    TEMPLATE_ERROR, first if isinstance(e, TemplateError) else f"{type(e).__name__}: {first}"
                )
                continue
            # turns are the assistant messages' in order; a message may be marked untrained (weight 0)
            trained = [t for t, ok in zip(turns, _assistant_flags(ex), strict=True) if ok]
            if self.train_on == "last_assistant":
                trained = trained[-1:]
            spans = [(t.start, t.stop_end) for t in trained]
            ends_with_assistant = ex.messages[-1]["role"] == "assistant" and bool(turns)
            eos_rule = (
                None
                if not ends_with_assistant or turns[-1].stop_is_token
                else bool(trained) and trained[-1] is turns[-1]
            )
            if eos_rule:  # what the template writes after the last end mark (chatml's "\n") leads to the
                spans[-1] = (spans[-1][0], len(text))  # trained EOS: trained too, or nothing teaches it
            kept.append((i, text, spans, eos_rule))
        if not kept:  # every conversation of the batch was dropped (a fast tokenizer refuses an empty batch)
            return []
        enc = self.tokenizer([k[1] for k in kept], add_special_tokens=False, return_offsets_mapping=True)
        out = []
        for (i, _, spans, eos_rule), ids, offsets in zip(kept, enc["input_ids"], enc["offset_mapping"], strict=True):
            out.append((i, (list(ids), masking.label_tokens(ids, offsets, spans, IGNORE_INDEX), eos_rule)))
        return out

    # ------------------------------------------------------------------ length policy

    def _finish(self, out: dict[str, list[Any]], ids: list[int], labels: list[int]) -> None:
        length = len(ids)
        drop = None
        cut = out.setdefault(ANSWERS_CUT, [])
        cut.append(answers_cut(labels, self.seq_len))
        if length > self.seq_len:
            if self.overlong == "drop":
                cut[-1] = answers_cut(labels, 0)  # dropped: every trained token and end of turn lost
                self._emit(out, [], [], length, Drop(OVERLONG, f"{length} tokens, data.seq_len is {self.seq_len}"))
                return
            out_labels, ids, labels = labels, ids[: self.seq_len], labels[: self.seq_len]
            if all(x == IGNORE_INDEX for x in labels):
                drop = Drop(
                    NO_TRAINABLE_AFTER_TRUNCATION, f"nothing trained in its first {self.seq_len} of {length} tokens"
                )
                cut[-1] = answers_cut(out_labels, 0)
        elif all(x == IGNORE_INDEX for x in labels):
            drop = Drop(NO_TRAINABLE, "no token to train (no assistant turn, or every one untrained)")
        if drop is not None:
            self._emit(out, [], [], length, drop)
        else:
            self._emit(out, ids, labels, length, None)

    @staticmethod
    def _emit(
        out: dict[str, list[Any]], ids: Sequence[int], labels: Sequence[int], length: int, drop: Drop | None
    ) -> None:
        out["input_ids"].append(list(ids))
        out["labels"].append(list(labels))
        out["length"].append(length)
        out["status"].append(drop.reason if drop is not None else "")
        out["detail"].append(drop.detail if drop is not None else "")


def _system_as_served(ex: formats.Example) -> formats.Example:
    """`ex` with its system prompt where the template serves it (masking.system_as_served), said once."""
    assert ex.messages is not None and ex.trainable is not None
    folded = masking.system_as_served(ex.messages)
    if folded is None:
        return ex
    global _SAID_SYSTEM
    if not _SAID_SYSTEM:
        _SAID_SYSTEM = True
        print(
            "spotune: the chat template writes the system prompt only before the generation prompt (as Mistral "
            "v0.3 does); it is trained inside the last user turn, where a chat endpoint sends it",
            file=sys.stderr,
            flush=True,
        )
    flags = [ok for m, ok in zip(ex.messages, ex.trainable, strict=True) if m["role"] != "system"]
    return dataclasses.replace(ex, messages=folded, trainable=flags)


_SAID_SYSTEM = False
_SAID_AUTO: set[str] = set()
"""The `data.format=auto -> ...` lines this process has printed."""


def _assistant_flags(ex: formats.Example) -> list[bool]:
    assert ex.messages is not None and ex.trainable is not None
    return [ok for m, ok in zip(ex.messages, ex.trainable, strict=True) if m["role"] == "assistant"]


def _conversational_pc(fmt: str, head: list[dict[str, Any]], fields: dict[str, str]) -> bool:
    """prompt/completion in the conversational (list of messages) form, which needs a template."""
    return fmt == "prompt_completion" and any(isinstance(r.get(fields["prompt"]), list) for r in head)


def tokenize_for(cfg: Any, tokenizer: Any, source: str) -> Tokenize:
    """The Tokenize of a DataConfig's settings (prepare and `spotune inspect` both build it here)."""
    return Tokenize(
        cfg.format,
        tokenizer,
        formats.fields_of(cfg.format, cfg),
        cfg.seq_len,
        cfg.overlong,
        cfg.chat_template,
        source=source,
        roles={**formats.SHAREGPT_ROLES, **cfg.sharegpt_roles},
        train_on=cfg.train_on,
        train_on_inputs=cfg.train_on_inputs,
        template_date=cfg.template_date,
    )


def end_of_turn_ids(tokenizer: Any, chat_template: str | None, fmt: str) -> list[int]:
    """The tokens a run trains as the end of an assistant turn: what generation must stop on.

    Conversational data: the last trained token of a probe conversation tokenised exactly as the
    rows are (the template's end-of-turn token, `<|im_end|>`, `<|eot_id|>`..., or the EOS appended
    where the template ends a turn with none); raw text and raw prompt/completion: EOS. `auto` and
    prompt/completion may be either, so both count; preference pairs are conversations where a template
    renders them, raw text (EOS) where none does."""
    ids: list[int] = []
    fmt = formats.normalise(fmt)
    templated = fmt != "text" and resolve_chat_template(chat_template, tokenizer) is not None
    if templated:
        probe = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
        out = Tokenize("messages", tokenizer, {"messages": "messages"}, 1 << 20, "truncate", chat_template)(
            {"messages": [probe]}
        )
        ids += [lab for lab in out["labels"][0] if lab != IGNORE_INDEX][-1:]
    # Preference pairs without a template are raw prompt/answer strings, whose answers end in EOS.
    raw_pairs = fmt == "preference" and not templated
    if (fmt in ("text", "auto", "prompt_completion") or raw_pairs) and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return list(dict.fromkeys(ids))


def answers_cut(labels: Sequence[int], seq_len: int) -> list[int]:
    """[trained tokens, trained tokens at or past `seq_len`, answers, answers whose last trained token (the
    end of turn that teaches the model to stop) is at or past `seq_len`] of one example's full labels; an
    answer is a run of trained tokens. `seq_len` 0: the example is dropped, everything lost."""
    trained = lost = answers = ends = 0
    previous = False
    for i, label in enumerate(labels):
        now = label != IGNORE_INDEX
        if now:
            trained += 1
            lost += i >= seq_len
            if not previous:
                answers += 1
        if previous and not now and i - 1 >= seq_len:
            ends += 1
        previous = now
    if previous and len(labels) - 1 >= seq_len:
        ends += 1
    return [trained, lost, answers, ends]
