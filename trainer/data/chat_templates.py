"""Which chat template a run trains with, and so ships: the tokenizer's own, a named one, or a Jinja string.

`resolve_chat_template` is the one answer, asked by the data pipeline (what rows are rendered
with) and by `final/` and `spotune export` (what the saved tokenizer carries), so a server
that applies the saved template builds the prompts the model was trained on.
"""

from __future__ import annotations

import datetime
import difflib
import re
from typing import Any

from trainer.data.read import DataError

_BOS = "{% if bos_token %}{{ bos_token }}{% endif %}"
_EOS = "{% if eos_token %}{{ eos_token }}{% endif %}"

NAMED: dict[str, str] = {
    # OpenAI's ChatML, as Qwen and many others use it.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Llama 3's headers and <|eot_id|>, without 3.1's date header.
    "llama3": (
        _BOS + "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    # The Stanford alpaca prompt (a system message replaces its preamble), turn after turn.
    "alpaca": (
        _BOS + "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}"
        "{% set turns = messages[1:] %}{% else %}"
        "{{ 'Below is an instruction that describes a task. "
        "Write a response that appropriately completes the request.\\n\\n' }}"
        "{% set turns = messages %}{% endif %}"
        "{% for message in turns %}{% if message['role'] == 'assistant' %}"
        "{{ '### Response:\\n' + message['content'] }}" + _EOS + "{% if not loop.last %}{{ '\\n\\n' }}{% endif %}"
        "{% else %}{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}"
    ),
}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}
"""Text a named template closes an assistant turn with, for tokenizers that lack it as one special token."""

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


def alpaca_prompt(instruction: str, input_text: str) -> str:
    """The original Stanford-alpaca prompt with its `### Input:` section (benchmarks compare with it)."""
    if input_text.strip():
        return ALPACA_WITH_INPUT.format(instruction=instruction, input=input_text)
    return ALPACA_NO_INPUT.format(instruction=instruction)


def own_template(tokenizer: Any) -> str | None:
    """The tokenizer's chat template (the default one when it ships several), or None."""
    tmpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tmpl, dict):
        tmpl = tmpl.get("default")
    return tmpl or None


def resolve_chat_template(setting: str | None, tokenizer: Any) -> str | None:
    """data.chat_template -> the Jinja text conversations are rendered with (None: there is none).

    Unset: the tokenizer's own. A name of NAMED: that template. Jinja text (it holds `{{` or `{%`):
    itself. Anything else is a name that is not known (a misspelling is never rendered as text)."""
    if setting is None:
        return own_template(tokenizer)
    if setting in NAMED:
        return NAMED[setting]
    if "{{" in setting or "{%" in setting:
        return setting
    close = difflib.get_close_matches(setting, list(NAMED), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise DataError(
        f"data.chat_template: {setting!r} is not a known template; {hint}set it to one of {', '.join(NAMED)}, "
        "to Jinja text (a template holds {{ or {%), or unset it for the tokenizer's own."
    )


_STRFTIME = re.compile(r"""strftime_now\(\s*(["'])(.*?)\1\s*\)""")


def uses_date(template: str | None) -> bool:
    """Whether a template writes the day it is rendered (Llama 3.2/3.3 write "Today Date: ...")."""
    return template is not None and "strftime_now" in template


def dated(template: str, date: str | None) -> str:
    """`template` with each `strftime_now("<format>")` written as `date` (YYYY-MM-DD; None: today, UTC) in
    that format, so a row renders the same on every day it is prepared (`data.template_date`). The
    template that ships keeps `strftime_now`: a server writes its own day."""
    if not uses_date(template):
        return template
    day = datetime.date.fromisoformat(date) if date else datetime.datetime.now(datetime.timezone.utc).date()
    return _STRFTIME.sub(lambda m: '"' + day.strftime(m.group(2)).replace('"', '\\"') + '"', template)


def template_name(setting: str | None) -> str:
    """How the summary and `inspect` name the template."""
    if setting is None:
        return "the tokenizer's own"
    return setting if setting in NAMED else "data.chat_template (Jinja)"


def require_template(template: str | None, fmt: str, tokenizer_path: str) -> str:
    if template is None:
        raise DataError(
            f"data.format is {fmt!r} but the tokenizer at {tokenizer_path} has no chat template (a base model); "
            f"set data.chat_template to one of {', '.join(NAMED)} or a Jinja template, and final/ will carry it."
        )
    return template


def apply_to_saved(tokenizer: Any, setting: str | None) -> None:
    """Give a tokenizer about to be saved (final/, a merged export) the template the run trained with."""
    if setting is not None:  # unset: the tokenizer keeps its own (all of them, when it ships several)
        tokenizer.chat_template = resolve_chat_template(setting, tokenizer)
