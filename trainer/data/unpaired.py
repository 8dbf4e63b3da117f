"""Unpaired feedback for KTO: TRL's unpaired rows (`prompt`, `completion`, a bool `label`: thumbs up or
down) -> per row the labelled answer's sequence and its KL sequence, one unit to pack like a pair.

What a row may look like (TRL's unpaired format, read as TRL's KTOTrainer reads it): `prompt` and
`completion` both strings (no chat template: raw, the completion and EOS trained) or both message lists
(rendered by the chat template, the completion's assistant turns trained), and `label` a bool (true:
desirable). Bad rows are counted drops with their file and line (trainer/data/dropped.py): a missing
label (`null_field`), a label that is not a bool (`label_not_bool`: 1, "yes"), an empty completion
(`empty_answer`), and every drop the prompt/completion format has.

KTO's reference point (the KL term) is estimated from mismatched sequences: prompt i with another row's
completion. TRL builds them when it prepares the data, rotating completions by one within each block of
`per_device_train_batch_size` rows (row i takes row i-1's completion, the block's first its last), then
concatenates token ids: prompt_i's ids + the other completion's ids. Here the same rotation runs over
each source's kept rows in file order (row i takes the previous kept row's completion, the first the
last's), at the token level as TRL does (`with_kl`), so the KL sequences are fixed by the data, never by
the sampler's order or the micro-batch split. With one block holding the whole source, TRL's KL
sequences and these are the same tokens (tests/test_kto.py compares them).

A unit (one row) is then packed as a preference pair is (trainer/data/pairs.py `documents`): the answer's
sequence first, its KL sequence second, both labelled, in one packed row; the packed row lists its units'
labels in `desirable` (1 desirable, 0 undesirable), in order. Each sequence is capped by TRL's length
settings apart (data.max_length, data.max_prompt_length, data.max_completion_length) and both must fit
data.seq_len, cut as a pair's two answers are (`overlong: truncate`) or dropped (`overlong: drop`).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer.data import formats
from trainer.data.chat_templates import require_template
from trainer.data.pairs import EMPTY_ANSWER, Lengths, fit_two
from trainer.data.read import DataError, unpacked
from trainer.data.template import (
    IGNORE_INDEX,
    NO_TRAINABLE,
    NULL_FIELD,
    Tokenize,
    tokenize_for,
)
from trainer.data.turns import Drop, bad_text

if TYPE_CHECKING:  # imported where rows are read: a run on prepared data never needs it (trainer/data/packed.py)
    import datasets

FORMAT = "prompt_completion"
LABEL = "label"
"""TRL's column of the answer's feedback: true (desirable) or false (undesirable)."""
DESIRABLE = "desirable"
"""The column of tokenised rows (1, 0; -1 dropped) and of packed rows (one per unit, in order)."""
NOT_BOOL = "label_not_bool"
"""Drop reason: the row's `label` is not true or false (TRL's KTOTrainer reads a bool)."""
BALANCE = (1.0, 4.0 / 3.0)
"""KTO's paper (eq. 8): desirable_weight x desirable / (undesirable_weight x undesirable) within this range."""


def is_unpaired(fmt: str, columns: list[str], fields: dict[str, str]) -> bool:
    """Whether a source of a preference objective holds unpaired feedback: format prompt_completion, or
    `auto` with a completion and a `label` column and no chosen answer."""
    if formats.normalise(fmt) == FORMAT:
        return True
    return (
        fmt == "auto"
        and LABEL in columns
        and fields.get("completion", "completion") in columns
        and fields.get("chosen", "chosen") not in columns
    )


@dataclass
class TokenizeUnpaired:
    """Rows -> per row the answer's sequence (prompt + completion, the completion trained), for
    `datasets.map(batched=True)`: input_ids, labels, length, status, detail, desirable. `with_kl` adds
    each row's KL sequence afterwards (it needs the other rows)."""

    tok: Tokenize
    lengths: Lengths = dataclasses.field(default_factory=lambda: Lengths())

    def settle(self, columns: list[str], head: list[dict[str, Any]], tokenizer_path: str = "") -> TokenizeUnpaired:
        fields = formats.settled_fields(FORMAT, "", self.tok.fields)
        need = [c for c in (fields["prompt"], fields["completion"], LABEL) if c not in columns]
        if need:
            raise DataError(
                f"{self.tok.source}: train.objective=kto reads TRL's unpaired rows (prompt, completion and a bool "
                f"label), but {', '.join(map(repr, need))} is not among the fields found "
                f"({', '.join(columns) or 'none'}); set data.prompt_field / data.completion_field, or write the "
                f"feedback as a {LABEL!r} column of true/false"
            )
        why = f"unpaired feedback: prompt {fields['prompt']!r}, completion {fields['completion']!r}, label {LABEL!r}"
        print(f"spotune: {self.tok.source}: kto: {why}", file=sys.stderr, flush=True)
        tok = dataclasses.replace(self.tok, fmt=FORMAT, fields=fields, reason=why)
        first = next((r.get(fields["completion"]) for r in head if r.get(fields["completion"]) is not None), None)
        if not isinstance(first, str):
            require_template(tok.template, FORMAT, tokenizer_path or str(tok.source))
        tok.say_unread([c for c in columns if c != LABEL])
        return dataclasses.replace(self, tok=tok)

    def __call__(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        tok = self.tok
        columns = list(batch)
        rows = [unpacked(dict(zip(columns, values, strict=True))) for values in zip(*batch.values(), strict=True)]
        template = tok.template
        drops: list[Drop | None] = []
        examples: list[formats.Example | None] = []
        for row in rows:
            drop = bad_text(row, tok.fields) or _label_drop(row.get(LABEL)) or _completion_drop(row, tok.fields)
            ex = drop or formats.to_example(FORMAT, row, tok.fields, tok.roles, template is not None)
            drops.append(ex if isinstance(ex, Drop) else None)
            examples.append(None if isinstance(ex, Drop) else ex)
        encoded = tok.encode(examples, rows, drops, template)
        out: dict[str, list[Any]] = {k: [] for k in ("input_ids", "labels", "length", "status", "detail", DESIRABLE)}
        for row, (ids, labels), drop in zip(rows, encoded, drops, strict=True):
            if drop is None and not any(x != IGNORE_INDEX for x in labels):
                drop = Drop(NO_TRAINABLE, "the completion has no trained token")
            out["input_ids"].append([] if drop else ids)
            out["labels"].append([] if drop else labels)
            out["length"].append(len(ids) if drop is None or drop.reason != NULL_FIELD else 0)
            out["status"].append(drop.reason if drop else "")
            out["detail"].append(drop.detail if drop else "")
            out[DESIRABLE].append(-1 if drop else int(row[LABEL]))
        return out


def _label_drop(label: Any) -> Drop | None:
    if label is None:
        return Drop(NULL_FIELD, f"field {LABEL!r} is missing or null")
    if not isinstance(label, bool):
        return Drop(NOT_BOOL, f"field {LABEL!r} is {label!r}: true (desirable) or false (undesirable)")
    return None


def _completion_drop(row: dict[str, Any], fields: dict[str, str]) -> Drop | None:
    """An empty completion (nothing to score): an empty string, or messages without text or tool calls."""
    value = row.get(fields["completion"])
    if isinstance(value, str):
        return Drop(EMPTY_ANSWER, "the completion holds no text") if not value.strip() else None
    if isinstance(value, list) and all(
        isinstance(m, dict)
        and isinstance(m.get("content"), str)
        and not m["content"].strip()
        and not m.get("tool_calls")
        for m in value
    ):
        return Drop(EMPTY_ANSWER, "the completion holds no text")
    return None


def tokenize_unpaired_for(cfg: Any, tokenizer: Any, source: str) -> TokenizeUnpaired:
    """The unpaired tokenizer of a DataConfig's settings (prepare and `spotune inspect` build it here)."""
    lengths = Lengths(cfg.max_length, cfg.max_prompt_length, cfg.max_completion_length, cfg.truncation_mode)
    return TokenizeUnpaired(tokenize_for(cfg, tokenizer, source), lengths)


def with_kl(tokenized: datasets.Dataset, lengths: Lengths, seq_len: int, overlong: str) -> datasets.Dataset:
    """The tokenised rows of one source with each kept row's KL sequence after its own (TRL's rotation, see
    the module docstring), both capped and fitted to `seq_len`: input_ids and labels (both sequences),
    chosen_length (the answer's sequence), length, status, detail, desirable. A row whose two sequences do
    not fit is dropped here (its KL sequence's completion still serves its neighbour: the rotation is fixed
    before any length policy, as TRL fixes it before its collator truncates)."""
    status = list(tokenized["status"])
    detail = list(tokenized["detail"])
    ids_all, labels_all = tokenized["input_ids"], tokenized["labels"]
    kept = [i for i, s in enumerate(status) if s == ""]
    prompt_end = {i: _first_label(labels_all[i]) for i in kept}
    out_ids: list[list[int]] = [[] for _ in status]
    out_labels: list[list[int]] = [[] for _ in status]
    chosen_length = [0] * len(status)
    length = list(tokenized["length"])
    for p, i in enumerate(kept):
        j = kept[p - 1]  # the previous kept row's completion; the first row takes the last's
        a, b = prompt_end[i], prompt_end[j]
        own = (ids_all[i], labels_all[i])
        kl = (ids_all[i][:a] + ids_all[j][b:], [IGNORE_INDEX] * a + labels_all[j][b:])
        length[i] = len(own[0]) + len(kl[0])  # both, before any cut
        fitted = fit_two(own, kl, lengths, seq_len, overlong, "the answer and its KL sequence", "a sequence")
        if isinstance(fitted, Drop):
            status[i], detail[i] = fitted.reason, fitted.detail
            continue
        (s_ids, s_lab), (k_ids, k_lab) = fitted
        out_ids[i], out_labels[i], chosen_length[i] = s_ids + k_ids, s_lab + k_lab, len(s_ids)
    desirable = [d if s == "" else -1 for d, s in zip(tokenized[DESIRABLE], status, strict=True)]
    import datasets

    return datasets.Dataset.from_dict(
        {
            "input_ids": out_ids,
            "labels": out_labels,
            "length": length,
            "status": status,
            "detail": detail,
            "chosen_length": chosen_length,
            DESIRABLE: desirable,
        },
        # The tokenised rows' own types, and the answer's length in the row (as a pair's chosen one).
        features=datasets.Features({**tokenized.features, "chosen_length": datasets.Value("int32")}),
    )


def _first_label(labels: list[int]) -> int:
    return next((k for k, x in enumerate(labels) if x != IGNORE_INDEX), len(labels))


def counts(tokenized: datasets.Dataset) -> dict[str, int]:
    """The manifest's desirable and undesirable counts among kept rows (dropped rows are -1); {} for pairs."""
    if DESIRABLE not in tokenized.column_names:
        return {}
    arr = np.asarray(tokenized[DESIRABLE])
    return {"desirable": int((arr == 1).sum()), "undesirable": int((arr == 0).sum())}


def row_labels(tokenized: datasets.Dataset, bins: list[list[int]]) -> list[list[int]] | None:
    """Per packed row, its units' labels in order, from the document bins (unit k = documents 2k, 2k+1:
    pairs.documents); None for rows that are not KTO's."""
    if DESIRABLE not in tokenized.column_names:
        return None
    labels = np.asarray(tokenized[DESIRABLE], dtype=np.int8)
    return [[int(labels[d // 2]) for d in b[0::2]] for b in bins]


def balance_note(
    n_desirable: int, n_undesirable: int, desirable_weight: float, undesirable_weight: float
) -> str | None:
    """KTO's guidance on the weights when the labels are unbalanced (TRL warns the same), or None within it."""
    if not n_desirable or not n_undesirable:
        which = "desirable" if not n_desirable else "undesirable"
        return f"kto: no {which} answer in the data: KTO learns from both; add some, or expect a one-sided run"
    ratio = desirable_weight * n_desirable / max(undesirable_weight * n_undesirable, 1e-12)
    if BALANCE[0] <= ratio <= BALANCE[1] + 1e-9:
        return None
    low, high = (undesirable_weight * n_undesirable / n_desirable * b for b in BALANCE)
    return (
        f"kto: {n_desirable} desirable and {n_undesirable} undesirable answers with train.desirable_weight="
        f"{desirable_weight:g} train.undesirable_weight={undesirable_weight:g}: desirable_weight x desirable / "
        f"(undesirable_weight x undesirable) is {ratio:.3g}, outside KTO's recommended 1 to 4/3; set "
        f"train.desirable_weight within [{low:.3g}, {high:.3g}] (or train.undesirable_weight within "
        f"[{desirable_weight * n_desirable / n_undesirable / BALANCE[1]:.3g}, "
        f"{desirable_weight * n_desirable / n_undesirable:.3g}])"
    )
