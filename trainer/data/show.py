"""Look at what trains: examples rendered as the model sees them, trained tokens marked.

`spotune inspect --show N` prints the first N rows that train from each source (after its
`rows`/`fraction` choice and the held-out split, as `prepare` reads them), each with its file and
line (ANSI colour on a terminal, `[[...]]` around trained text otherwise); `example_html` gives the
same marks as HTML for a page (the report may embed it). Rows are tokenised by the very `Tokenize`
that `prepare` uses; preference pairs (`pairs`) by its `TokenizePairs`, shown as the prompt they
share, then each answer.
"""

from __future__ import annotations

import html
from typing import Any

from trainer.config import DataConfig
from trainer.data import dropped, rows
from trainer.data.chat_templates import template_name
from trainer.data.formats import FORMAT_FIELDS
from trainer.data.read import LINE_COLUMN
from trainer.data.sources import FILE_COLUMN, eval_sources, locate, sources_of
from trainer.data.template import HEAD_ROWS, IGNORE_INDEX

OPEN, CLOSE = "[[", "]]"
ANSI_ON, ANSI_OFF = "\x1b[30;42m", "\x1b[0m"  # black on green: trained


def segments(tokenizer: Any, ids: list[int], labels: list[int]) -> list[tuple[str, bool]]:
    """(decoded text, trained) for each run of tokens that are all trained or all not."""
    runs: list[tuple[list[int], bool]] = []
    for t, lab in zip(ids, labels, strict=True):
        trained = lab != IGNORE_INDEX
        if runs and runs[-1][1] == trained:
            runs[-1][0].append(t)
        else:
            runs.append(([t], trained))
    return [(tokenizer.decode(r, skip_special_tokens=False), trained) for r, trained in runs]


def example_text(tokenizer: Any, ids: list[int], labels: list[int], color: bool = False) -> str:
    """One example as text: trained runs in colour (`color`) or between `[[` and `]]`."""
    on, off = (ANSI_ON, ANSI_OFF) if color else (OPEN, CLOSE)
    return "".join(f"{on}{text}{off}" if trained else text for text, trained in segments(tokenizer, ids, labels))


def example_html(tokenizer: Any, ids: list[int], labels: list[int]) -> str:
    """One example as an HTML fragment: a <pre> whose trained runs are <mark class="trained">."""
    parts = [
        f'<mark class="trained">{html.escape(text)}</mark>' if trained else html.escape(text)
        for text, trained in segments(tokenizer, ids, labels)
    ]
    return f'<pre class="spotune-example">{"".join(parts)}</pre>'


def show_examples(
    cfg: DataConfig, tokenizer_path: str, n: int, color: bool = False, seed: int = 0, pairs: bool = False
) -> str:
    """The first `n` training rows of each source of `cfg` (`data.path`, or each of `data.sources`,
    located, read and chosen as prepare reads them with `seed`), rendered with that source's format
    and fields, trained tokens marked; `pairs`: as preference pairs (train.objective dpo/orpo/simpo)."""
    from trainer.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    lines = ["trained tokens are " + ("highlighted" if color else f"between {OPEN} and {CLOSE}")]
    located = [locate(src) for src in sources_of(cfg, FORMAT_FIELDS)]
    held_out = bool(eval_sources(cfg, FORMAT_FIELDS))
    for loc, ds in rows.read_training(cfg, located, held_out, seed).train:
        shown = rows.head(ds, max(n, HEAD_ROWS))
        mapped, tok = rows.tokenize_source(loc, cfg, ds, shown, tokenizer, tokenizer_path, pairs)
        shown = shown[:n]
        out = mapped({c: [r[c] for r in shown] for c in ds.column_names})
        template = template_name(tok.chat_template) if tok.template is not None else "none (raw text)"
        name = f"{loc.source.key} {loc.label}" if cfg.sources else loc.label
        why = f" ({tok.reason})" if tok.reason else ""
        lines.append(f"\n{name}: format {tok.fmt}{why}, chat template: {template}")
        for i, (row, ids, labels, status, detail) in enumerate(
            zip(shown, out["input_ids"], out["labels"], out["status"], out["detail"], strict=True)
        ):
            place = dropped.place(loc.files[row[FILE_COLUMN]], row[LINE_COLUMN])
            if status:
                lines.append(f"\n--- {place}: dropped ({status}{': ' + detail if detail else ''})")
            elif pairs and "chosen_length" in out:  # KTO's answers show alone (their KL sequences come at prepare)
                lines += _pair_lines(tokenizer, place, ids, labels, out["chosen_length"][i], out["length"][i], color)
            else:
                trained = sum(lab != IGNORE_INDEX for lab in labels)
                said = ("un" if not out["desirable"][i] else "") + "desirable, " if "desirable" in out else ""
                lines.append(f"\n--- {place}: {said}{len(ids)} tokens, {trained} trained")
                lines.append(example_text(tokenizer, ids, labels, color))
    return "\n".join(lines)


def _pair_lines(
    tokenizer: Any, place: str, ids: list[int], labels: list[int], chosen_length: int, length: int, color: bool
) -> list[str]:
    """One pair: the prompt both answers follow (never trained), then the chosen and the rejected answer."""
    c_ids, c_lab, r_ids, r_lab = (
        ids[:chosen_length],
        labels[:chosen_length],
        ids[chosen_length:],
        labels[chosen_length:],
    )
    shared = next((k for k, lab in enumerate(c_lab) if lab != IGNORE_INDEX), len(c_lab))
    trained = [sum(x != IGNORE_INDEX for x in lab) for lab in (c_lab, r_lab)]
    cut = f" (truncated from {length})" if length > len(ids) else ""
    return [
        f"\n--- {place}: pair of {len(c_ids)} + {len(r_ids)} tokens{cut}, {trained[0]} + {trained[1]} scored",
        "prompt:",
        example_text(tokenizer, c_ids[:shared], c_lab[:shared], color),
        "chosen:",
        example_text(tokenizer, c_ids[shared:], c_lab[shared:], color),
        "rejected:",
        example_text(tokenizer, r_ids[shared:], r_lab[shared:], color),
    ]
