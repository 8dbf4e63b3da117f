"""Pinned together: the tokenizer and its chat template load at the weights' revision and enter the
data fingerprint by their bytes; a template that writes the day renders the run's first day on
every restart; and the rendering of rows cannot change without a new PIPELINE_VERSION.

A hub model is the huggingface_hub cache layout (refs/, snapshots/<commit>/, blobs/) in a temporary
HF_HOME, read with HF_HUB_OFFLINE=1 through the real `snapshot_download`."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import yaml
from test_data_sources import FakeHub, fake_hub  # noqa: F401 (fake_hub: a fixture)
from transformers import AutoTokenizer

from trainer import config as C
from trainer.config import DataConfig
from trainer.data import prepare
from trainer.data.prepare import data_fingerprint

ROWS = [{"instruction": "Name a colour.", "input": "", "output": "Blue."}]
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
# As Llama 3.2 and 3.3 write it: the day the prompt is rendered, unless the caller passes date_string.
DATED = (
    "{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}"
    "<|system|>\nToday Date: {{ date_string }}\n{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _data(tmp_path: Path) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def _text(p: Any, tokenizer: Path | str) -> str:
    tok = AutoTokenizer.from_pretrained(tokenizer)
    row = datasets.load_from_disk(str(p.train_path))[0]
    return str(tok.decode(row["input_ids"][: row["num_real"]]))


def _push_model(hub: FakeHub, tiny_tokenizer: Path, tmp_path: Path, commit: str, template: str) -> None:
    """A hub model whose tokenizer is the tiny one with `template`, at `commit` (main moves to it)."""
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    tok.chat_template = template
    folder = tmp_path / f"tok-{commit[:4]}"
    tok.save_pretrained(folder)
    files = {f.name: f.read_bytes() for f in folder.iterdir()}
    hub.push("org/model", files, commit, kind="models")


def test_the_tokenizer_loads_at_the_weights_revision_and_is_hashed_by_content(
    tmp_path: Path,
    tiny_tokenizer: Path,
    fake_hub: FakeHub,  # noqa: F811
) -> None:
    from trainer.training.inputs import tokenizer_path

    old = "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    _push_model(fake_hub, tiny_tokenizer, tmp_path, COMMIT_A, old)
    _push_model(
        fake_hub, tiny_tokenizer, tmp_path, COMMIT_B, old.replace("<|{{ m['role'] }}|>\n", "### {{ m['role'] }}:\n")
    )
    run = C.RunConfig().replace(
        **{"model.name_or_path": "org/model", "model.revision": COMMIT_A, "data.path": _data(tmp_path)}
    )
    pinned = tokenizer_path(run)
    assert Path(pinned).name == COMMIT_A  # the weights' commit, not main (B)
    at_a = prepare(run.data, pinned, tmp_path / "cache", progress=False)
    assert "<|user|>\nName a colour." in _text(at_a, pinned)
    # Control: at main the template changed upstream; that is other data, never the same cache entry.
    at_main = tokenizer_path(run.replace(**{"model.revision": None}))
    assert Path(at_main).name == COMMIT_B
    b = prepare(run.data, at_main, tmp_path / "cache", progress=False)
    assert b.fingerprint != at_a.fingerprint and "### user:\nName a colour." in _text(b, at_main)
    # data.tokenizer_revision pins another tokenizer than the model's; the fingerprint follows the bytes, not the id
    other = run.replace(**{"data.tokenizer": "org/model", "data.tokenizer_revision": COMMIT_B})
    assert tokenizer_path(other) == at_main
    assert data_fingerprint(run.data, "org/model") == b.fingerprint  # a hub id is hashed as its files at main
    copy = tmp_path / "copy-of-a"
    copy.mkdir()
    for f in Path(pinned).iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert data_fingerprint(run.data, str(copy)) == at_a.fingerprint  # same bytes elsewhere: the same data


def test_a_dated_template_renders_the_runs_day_on_every_restart(tmp_path: Path, tiny_tokenizer: Path) -> None:
    from trainer.training.inputs import pin_data

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    tok.chat_template = DATED
    dated_tok = tmp_path / "dated-tokenizer"
    tok.save_pretrained(dated_tok)
    data = DataConfig(path=_data(tmp_path), seq_len=128)

    def prep(**kw: Any) -> Any:
        return prepare(dataclasses.replace(data, **kw), str(dated_tok), tmp_path / "cache", progress=False)

    first = prep(template_date="2024-07-26")
    assert "Today Date: 26 Jul 2024\n" in _text(first, dated_tok)
    assert prep(template_date="2024-07-26").reused  # the same day: the same rows
    later = prep(template_date="2025-01-02")
    assert later.fingerprint != first.fingerprint and "Today Date: 02 Jan 2025\n" in _text(later, dated_tok)
    # A template that writes no day: the day is no part of its data.
    plain = DataConfig(path=data.path, seq_len=128)
    fps = {
        data_fingerprint(dataclasses.replace(plain, template_date=d), str(tiny_tokenizer))
        for d in ("2024-07-26", "2025-01-02")
    }
    assert len(fps) == 1
    # The run's first start pins its day in config.yaml; a restart on another day renders that day.
    out = tmp_path / "run"
    run = C.RunConfig().replace(**{"output_dir": str(out), "data.path": data.path, "data.tokenizer": str(dated_tok)})
    today = pin_data(run).data.template_date
    assert today is not None and len(today) == 10
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump(run.replace(**{"data.template_date": "2024-07-26"}).to_dict()))
    assert pin_data(run).data.template_date == "2024-07-26"  # kept from the first start
    assert pin_data(run.replace(**{"data.template_date": "2023-03-03"})).data.template_date == "2023-03-03"  # as set
    with pytest.raises(C.ConfigError, match="data.template_date: expected a day as YYYY-MM-DD"):
        run.replace(**{"data.template_date": "26 Jul 2024"})


def test_config_yaml_is_written_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write cut short (here: text that cannot be encoded, past the first bytes) leaves no config.yaml:
    a torn one would exist, so no later start would write it again, and never load, so every restart would
    pin the hub data and the day anew."""
    from trainer.training.inputs import saved_config, write_config

    run = C.RunConfig().replace(**{"output_dir": str(tmp_path / "run"), "data.template_date": "2024-07-26"})
    whole = C.to_yaml(run)
    monkeypatch.setattr(C, "to_yaml", lambda cfg: whole + "# \udc80\n")
    with pytest.raises(UnicodeEncodeError):
        write_config(tmp_path / "run", run)
    assert not (tmp_path / "run" / "config.yaml").exists() and saved_config(tmp_path / "run") is None
    monkeypatch.undo()
    write_config(tmp_path / "run", run)  # the control: written whole, it loads, and a second start keeps it
    write_config(tmp_path / "run", run.replace(**{"data.template_date": "2025-01-02"}))
    saved = saved_config(tmp_path / "run")
    assert saved is not None and saved.data.template_date == "2024-07-26"


# ----------------------------------------------------------------------------- the pipeline's version

RENDERED: dict[str, str] = {
    "3": "9a3c28de8a919be9",
    "4": "c7134cb5890afdd5",
    "5": "5ae1348619598416",
    "6": "c6eb994324815b7b",
}
"""PIPELINE_VERSION -> the digest of what the pipeline makes of GOLDEN and PAIRS (ids, labels, drops, packed rows);
an old entry is the digest of the fixture of its day."""
CALL = {"id": "call00001", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
GOLDEN: dict[str, list[dict[str, Any]]] = {
    "alpaca": [
        {"instruction": "Add.", "input": "2 + 3", "output": "5", "system": "Be exact."},
        {"instruction": "Say hi.", "output": "hi"},
        {"instruction": "Nothing back."},
    ],
    "prompt_completion": [
        {"prompt": "The sky is", "completion": " blue."},
        {"prompt": [{"role": "user", "content": "Sky?"}], "completion": [{"role": "assistant", "content": "Blue."}]},
    ],
    "messages": [
        {
            "messages": [
                {"role": "system", "content": "Terse."},
                {"role": "user", "content": "A?"},
                {"role": "assistant", "content": "a", "weight": 0},
                {"role": "user", "content": "B?"},
                {"role": "assistant", "content": "b"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Look x up."},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call00001", "content": "found"},
                {"role": "assistant", "content": "Found."},
            ],
            "tools": [{"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}],
        },
    ],
    "sharegpt": [
        {
            "conversations": [
                {"from": "human", "value": "Q?"},
                {"from": "function_call", "value": '{"name": "lookup", "arguments": {"q": "Q"}}'},
                {"from": "observation", "value": "42"},
                {"from": "gpt", "value": "42."},
            ]
        },
        {"conversations": [{"from": "narrator", "value": "Once."}, {"from": "gpt", "value": "Upon."}]},
        # LLaMA-Factory's ShareGPT form: the system prompt in a column beside the turns; a whitespace-only
        # tools cell (no tools); an empty call
        {
            "conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hi."}],
            "system": "Kind.",
            "tools": " ",
        },
        {"conversations": [{"from": "human", "value": "Do."}, {"from": "function_call", "value": ""}]},
    ],
    "text": [{"text": "Plain text, every token trained."}],
}
# Preference pairs, each list one source (its columns settle how its pairs read): a prompt column with
# the system and tools columns; and whole conversations sharing their prompt, whose turns carry the
# None-filled keys Arrow gives a column (a `name` only the rejected one has).
PAIRS: list[list[dict[str, Any]]] = [
    [
        {
            "prompt": [{"role": "user", "content": "Look x up."}],
            "chosen": [{"role": "assistant", "content": None, "tool_calls": [CALL]}],
            "rejected": [{"role": "assistant", "content": "No."}],
            "system": "Use tools.",
            "tools": json.dumps([{"name": "lookup", "parameters": {"type": "object"}}]),
        },
        {"prompt": "Sky?", "chosen": "Blue.", "rejected": "Green.", "system": None, "tools": "  "},
    ],
    [
        {
            "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
            "rejected": [
                {"role": "user", "content": "2+2?", "name": None},
                {"role": "assistant", "content": "5", "name": "bot"},
            ],
        }
    ],
    # hh-rlhf dialogues; an alpaca form; LLaMA-Factory's one-message answers; content parts; pre-templated strings
    [{"chosen": "\n\nHuman: Hi?\n\nAssistant: I am here.", "rejected": "\n\nHuman: Hi?\n\nAssistant: I left."}],
    [{"instruction": "Add.", "input": "2+2", "chosen": "4", "rejected": "5", "system": "Be exact."}],
    [
        {
            "conversations": [{"from": "human", "value": "Hi?"}],
            "chosen": {"from": "gpt", "value": "Hello."},
            "rejected": {"from": "gpt", "value": "Bye."},
        }
    ],
    [
        {
            "prompt": [{"role": "user", "content": [{"type": "text", "text": "Sky?"}]}],
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "Blue."}]}],
            "rejected": [{"role": "assistant", "content": "Green."}],
        },
        {"prompt": "<|user|>\nSky?\n<|assistant|>\n", "chosen": "Blue.<|end|>\n", "rejected": "Green.<|end|>\n"},
    ],
]
TOOL_TEMPLATE = (  # a template that renders tools and calls, as Qwen2.5's does
    "{% if tools %}<|system|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% for c in m.tool_calls or [] %}"
    '<call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</call>'
    "{% endfor %}{% if m['role'] == 'assistant' %}<|end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _byte_tokenizer() -> Any:
    """A byte-level tokenizer with no merges (built, not trained: the same ids on every version of
    `tokenizers`), so the digest follows the pipeline alone; a few specials end turns as templates do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_end|>", "<|end|>"]})
    fast.chat_template = TOOL_TEMPLATE
    return fast


def _rendering_digest(seq_len: int = 400) -> str:
    from trainer.data.chat_templates import NAMED
    from trainer.data.formats import SHAREGPT_ROLES, fields_default
    from trainer.data.pack import build_rows, pack_lengths
    from trainer.data.pairs import TokenizePairs
    from trainer.data.template import Tokenize

    tok = _byte_tokenizer()
    h = hashlib.sha256()
    settings: list[dict[str, Any]] = [{"chat_template": t} for t in (None, *NAMED)]
    settings += [
        {"train_on": "last_assistant"},
        {"train_on_inputs": True},
        {"chat_template": DATED, "template_date": "2024-07-26"},
    ]
    sources = [*GOLDEN.items(), *(("preference", rows) for rows in PAIRS)]
    for fmt, rows in sources:
        columns = list(dict.fromkeys(k for r in rows for k in r))
        for kw in settings:
            t: Any = Tokenize(fmt, tok, fields_default(), seq_len, "truncate", roles=dict(SHAREGPT_ROLES), **kw)
            if fmt == "preference":
                t = TokenizePairs(t).settle(columns, rows)
            out = t({k: [r.get(k) for r in rows] for k in columns})
            h.update(json.dumps([fmt, kw, out]).encode())
            kept = [i for i, st in enumerate(out["status"]) if not st]
            ids = [t for i in kept for t in out["input_ids"][i]]
            labels = [t for i in kept for t in out["labels"][i]]
            lens = [len(out["input_ids"][i]) for i in kept]
            if lens:
                offsets = np.asarray([0, *itertools.accumulate(lens)])
                bins, _ = pack_lengths(lens, 512)
                packed = build_rows(np.asarray(ids), np.asarray(labels), offsets, bins, 512, 0)
                h.update(json.dumps({k: v.tolist() for k, v in packed.items()}).encode())
    return h.hexdigest()[:16]


def test_rendering_changes_only_with_a_new_pipeline_version() -> None:
    """A prepared dataset is reused whenever its fingerprint matches, and PIPELINE_VERSION is part of
    it: a change of what rows render to, which tokens are trained or how they pack, made without a new
    version, would train on stale caches. This digest of every format through every named template
    (and the masking options) fails then."""
    from trainer.data.cache import PIPELINE_VERSION

    got = _rendering_digest()
    assert RENDERED.get(PIPELINE_VERSION) == got, (
        f"the pipeline's output changed: bump PIPELINE_VERSION in trainer/data/cache.py and record "
        f"RENDERED[<new version>] = {got!r} in this test (keep the old entries)"
    )
    assert _rendering_digest(seq_len=64) != got  # control: the digest sees a change of the rows (truncation here)
