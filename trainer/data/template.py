"""Templates: raw rows -> token ids + labels, with prompt tokens masked.

Label convention (shared with pack.py and the loss): labels are aligned with input_ids,
-100 means "no loss here", and the loss shifts (logits[:, :-1] predict labels[:, 1:]).
Therefore the first token of every document always carries -100: in a packed row it
would otherwise be predicted from the previous document's last token.

`Tokenize` is a picklable callable for `datasets.map(batched=True, with_indices=True)`.
It returns, per row, the (possibly truncated) ids and labels, the full token length
before truncation, and a status: "" (kept) or the reason the row is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from trainer.data.read import DataError

IGNORE_INDEX = -100
"""The label that carries no loss (PyTorch's cross_entropy default ignore_index); defined once here."""

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)

ROW_COLUMN = "__spotune_row"

# Drop reasons, as they appear in the manifest and the summary.
OVERLONG = "overlong"
NO_TRAINABLE = "no_trainable_tokens"
NO_TRAINABLE_AFTER_TRUNCATION = "no_trainable_after_truncation"
NULL_FIELD = "null_field"

# ids, labels, and whether an appended EOS is trained (None: append none, the template ends turns with EOS)
Pair = tuple[list[int], list[int], bool | None]

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def alpaca_prompt(instruction: str, input_text: str) -> str:
    """The standard Stanford-alpaca prompt; the response follows it directly."""
    if input_text.strip():
        return ALPACA_WITH_INPUT.format(instruction=instruction, input=input_text)
    return ALPACA_NO_INPUT.format(instruction=instruction)


@dataclass
class Tokenize:
    fmt: Literal["alpaca", "chat", "text"]
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    fields: dict[str, str]  # role -> column name: instruction/input/output, messages, text
    seq_len: int
    overlong: Literal["truncate", "drop"]
    chat_template: str | None = None
    source: str = "data"

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        # Row numbers of the source file (kept through the eval split) for error messages.
        indices = batch[ROW_COLUMN] if ROW_COLUMN in batch else list(range(len(next(iter(batch.values())))))
        status = [""] * len(indices)
        if self.fmt == "alpaca":
            pairs = self._alpaca(batch, status)
        elif self.fmt == "text":
            pairs = self._text(batch, status)
        else:
            pairs = self._chat(batch, indices, status)
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "length": [], "status": []}
        eos = self.tokenizer.eos_token_id
        for (ids, labels, eos_trained), st in zip(pairs, status, strict=False):
            if st:
                self._emit(out, [], [], 0, st)
                continue
            if eos is not None and eos_trained is not None and (not ids or ids[-1] != eos):
                # EOS teaches the model to stop: trained after a response (alpaca), after text,
                # and after a conversation that ends with an assistant turn.
                labels.append(eos if eos_trained else IGNORE_INDEX)
                ids.append(eos)
            if labels:
                labels[0] = IGNORE_INDEX  # see the module docstring: no prediction across documents
            self._finish(out, ids, labels)
        return out

    # ------------------------------------------------------------------ formats

    def _alpaca(self, batch: dict[str, list[Any]], status: list[str]) -> list[Pair]:
        f = self.fields
        instr = batch[f["instruction"]]
        inputs = batch[f["input"]] if f["input"] in batch else [""] * len(instr)
        outputs = batch[f["output"]]
        prompts, responses = [], []
        for i, (a, b, c) in enumerate(zip(instr, inputs, outputs, strict=False)):
            if a is None or c is None:
                status[i] = NULL_FIELD
            prompts.append(alpaca_prompt(str(a or ""), str(b or "")))
            responses.append(str(c or ""))
        # Prompt and response are tokenised apart and concatenated, so the mask boundary is
        # exact and the response starts where generation would start after the prompt.
        p_ids = self.tokenizer(prompts, add_special_tokens=True)["input_ids"]
        r_ids = self.tokenizer(responses, add_special_tokens=False)["input_ids"]
        return [
            (list(p) + list(r), [IGNORE_INDEX] * len(p) + list(r), True) for p, r in zip(p_ids, r_ids, strict=False)
        ]

    def _text(self, batch: dict[str, list[Any]], status: list[str]) -> list[Pair]:
        texts = batch[self.fields["text"]]
        for i, t in enumerate(texts):
            if t is None:
                status[i] = NULL_FIELD
        ids = self.tokenizer([str(t or "") for t in texts], add_special_tokens=True)["input_ids"]
        return [(list(x), list(x), True) for x in ids]  # every token trained; the first is masked later

    def _chat(self, batch: dict[str, list[Any]], indices: list[int], status: list[str]) -> list[Pair]:
        col = batch[self.fields["messages"]]
        tmpl = self.chat_template
        uses_generation = bool(_GENERATION_TAG.search(str(tmpl or self.tokenizer.chat_template or "")))
        result: list[Pair] = []
        texts: list[str] = []
        spans: list[list[tuple[int, int]]] = []
        ends_with_assistant: list[bool] = []
        for j, (messages, row) in enumerate(zip(col, indices, strict=False)):
            if messages is None:
                status[j] = NULL_FIELD
                messages = []
            messages = self._check_messages(messages, row)
            ends_with_assistant.append(bool(messages) and messages[-1]["role"] == "assistant")
            if uses_generation:
                # The template marks assistant text itself: let transformers compute the mask.
                enc = (
                    self.tokenizer.apply_chat_template(
                        messages, chat_template=tmpl, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
                    )
                    if messages
                    else {"input_ids": [], "assistant_masks": []}
                )
                ids = list(enc["input_ids"])
                labels = [t if m else IGNORE_INDEX for t, m in zip(ids, enc["assistant_masks"], strict=False)]
                result.append((ids, labels, self._eos_rule(ids, ends_with_assistant[-1])))
                continue
            text, sp = self._render_with_spans(messages, row)
            texts.append(text)
            spans.append(sp)
        if uses_generation:
            return result
        enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for ids, offsets, sp, last in zip(
            enc["input_ids"], enc["offset_mapping"], spans, ends_with_assistant, strict=False
        ):
            # A token belongs to the turn its first character belongs to.
            labels = [
                t if any(s <= start < e for s, e in sp) else IGNORE_INDEX
                for t, (start, _) in zip(ids, offsets, strict=False)
            ]
            result.append((list(ids), labels, self._eos_rule(ids, last)))
        return result

    def _eos_rule(self, ids: Sequence[int], ends_with_assistant: bool) -> bool | None:
        # A template that closes turns with EOS (often followed by a newline) needs no extra one.
        return None if self.tokenizer.eos_token_id in ids else ends_with_assistant

    def _render_with_spans(self, messages: list[dict[str, Any]], row: int) -> tuple[str, list[tuple[int, int]]]:
        """Render the conversation and find each assistant turn's characters by rendering prefixes.

        The text an assistant turn adds is render(messages[:i+1]) minus
        render(messages[:i], add_generation_prompt=True). This holds only if prefixes
        render as string prefixes of the whole, which is checked rather than assumed.
        """
        if not messages:
            return "", []

        def render(msgs: list[dict[str, Any]], gen: bool) -> str:
            out = self.tokenizer.apply_chat_template(
                msgs, chat_template=self.chat_template, tokenize=False, add_generation_prompt=gen
            )
            return str(out)

        full = render(messages, False)
        spans: list[tuple[int, int]] = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = render(messages[:i], True)
            upto = render(messages[: i + 1], False)
            if not (full.startswith(upto) and upto.startswith(before)):
                raise DataError(
                    f"{self.source}: row {row + 1}: the chat template does not render a conversation prefix as a prefix "
                    "of the whole, so assistant tokens cannot be located; mark assistant text with "
                    "{% generation %}...{% endgeneration %} in data.chat_template."
                )
            spans.append((len(before), len(upto)))
        return full, spans

    def _check_messages(self, messages: Any, row: int) -> list[dict[str, Any]]:
        if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise DataError(
                f"{self.source}: row {row + 1}: field {self.fields['messages']!r} must be a list of "
                "{'role': ..., 'content': ...} messages; set data.messages_field if another field holds them."
            )
        # Arrow stores a list of structs with the union of keys; drop the None-filled extras.
        return [{k: v for k, v in m.items() if v is not None} for m in messages]

    # ------------------------------------------------------------------ length policy

    def _finish(self, out: dict[str, list[Any]], ids: list[int], labels: list[int]) -> None:
        length = len(ids)
        status = ""
        if length > self.seq_len:
            if self.overlong == "drop":
                self._emit(out, [], [], length, OVERLONG)
                return
            ids, labels = ids[: self.seq_len], labels[: self.seq_len]
            if all(x == IGNORE_INDEX for x in labels):
                status = NO_TRAINABLE_AFTER_TRUNCATION
        elif all(x == IGNORE_INDEX for x in labels):
            status = NO_TRAINABLE
        if status:
            self._emit(out, [], [], length, status)
        else:
            self._emit(out, ids, labels, length, "")

    @staticmethod
    def _emit(out: dict[str, list[Any]], ids: Sequence[int], labels: Sequence[int], length: int, status: str) -> None:
        out["input_ids"].append(list(ids))
        out["labels"].append(list(labels))
        out["length"].append(length)
        out["status"].append(status)


def check_chat_template(tokenizer: Any, chat_template: str | None) -> None:
    """A chat dataset needs a template from the tokenizer or from data.chat_template."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "data.format is 'chat' but the tokenizer has no chat template; set data.chat_template "
            "to a Jinja chat template (or use a tokenizer that ships one)."
        )
