"""spotune prepare: readers, templates and masking, errors, cache reuse/invalidation, atomicity, summary."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pandas as pd
import pytest
from transformers import AutoTokenizer

from trainer.config import DataConfig, SourceConfig
from trainer.data import DataError, Prepared, prepare
from trainer.data.chat_templates import alpaca_prompt
from trainer.data.formats import alpaca_messages
from trainer.data.report import LENGTHS_PNG, lengths_plot, plot_lengths
from trainer.data.template import IGNORE_INDEX

ROWS = [
    {"instruction": "Add the two numbers.", "input": "2 + 3", "output": "5"},
    {"instruction": "What is the capital of France?", "input": "", "output": "The capital of France is Paris."},
    {"instruction": "Reverse the order of the words.", "input": "red green blue", "output": "blue green red"},
    {"instruction": "Repeat the list.", "input": "cat, dog", "output": "cat\ndog"},
]
CHAT_TEMPLATE_NO_GENERATION_TAGS = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prep(tmp_path: Path, tok: Path, cache: str = "cache", seed: int = 0, **kw: Any) -> Prepared:
    kw.setdefault("seq_len", 256)
    return prepare(DataConfig(**kw), str(tok), tmp_path / cache, progress=False, seed=seed)


def _rows(p: Prepared, split: str = "train") -> datasets.Dataset:
    return datasets.load_from_disk(str(p.train_path if split == "train" else p.eval_path))


def _docs(ds: datasets.Dataset) -> list[tuple[list[int], list[int]]]:
    """Every document of every row as (ids, labels), via position_ids."""
    out = []
    for row in ds:
        real, pos = row["num_real"], row["position_ids"]
        starts = [i for i in range(real) if pos[i] == 0]
        for s, e in zip(starts, starts[1:] + [real], strict=False):
            out.append((row["input_ids"][s:e], row["labels"][s:e]))
    return out


# ----------------------------------------------------------------------------- readers


def test_every_reader_gives_the_same_rows(tmp_path: Path, tiny_tokenizer: Path) -> None:
    sources = {
        "jsonl": _jsonl(tmp_path / "d.jsonl", ROWS),
        "json": tmp_path / "d.json",
        "parquet": tmp_path / "d.parquet",
        "csv": tmp_path / "d.csv",
        "saved": tmp_path / "saved",
        "saved_dict": tmp_path / "saved_dict",
    }
    sources["json"].write_text(json.dumps(ROWS, indent=1))
    pd.DataFrame(ROWS).to_parquet(sources["parquet"])
    pd.DataFrame(ROWS).to_csv(sources["csv"], index=False)  # the empty `input` becomes an empty cell
    datasets.Dataset.from_list(ROWS).save_to_disk(str(sources["saved"]))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(sources["saved_dict"]))
    results = {name: _rows(_prep(tmp_path, tiny_tokenizer, path=str(p))) for name, p in sources.items()}
    reference = results.pop("jsonl")
    assert reference.num_rows >= 1 and sum(reference["num_trainable"]) > 0
    for name, ds in results.items():
        assert ds["input_ids"] == reference["input_ids"], name
        assert ds["labels"] == reference["labels"], name


def test_configurable_field_names(tmp_path: Path, tiny_tokenizer: Path) -> None:
    renamed = [{"q": r["instruction"], "ctx": r["input"], "a": r["output"]} for r in ROWS]
    p = _prep(
        tmp_path,
        tiny_tokenizer,
        path=str(_jsonl(tmp_path / "r.jsonl", renamed)),
        instruction_field="q",
        input_field="ctx",
        output_field="a",
    )
    ref = _prep(tmp_path, tiny_tokenizer, path=str(_jsonl(tmp_path / "d.jsonl", ROWS)))
    assert _rows(p)["input_ids"] == _rows(ref)["input_ids"]


def test_a_column_the_first_row_lacks_is_read_in_every_row(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """Rows are read with the union of their keys: a later row's `input` and `system` reach its prompt
    (datasets' from_list, the former reader, takes the first row's keys for every row)."""
    rows = [
        {"instruction": "Name a year.", "output": "1789"},
        {"instruction": "When did it start?", "input": "French Revolution", "system": "Be brief.", "output": "1789"},
    ]
    explicit = [dict(rows[0], input="", system=None), rows[1]]  # every key in the first row
    reference = _docs(_rows(_prep(tmp_path, tiny_tokenizer, path=str(_jsonl(tmp_path / "all.jsonl", explicit)))))
    (tmp_path / "d.json").write_text(json.dumps(rows, indent=1))
    for path in (_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "d.json"):
        p = _prep(tmp_path, tiny_tokenizer, path=str(path), format="auto")
        assert _docs(_rows(p)) == reference, path
        assert p.manifest["train"]["examples_out"] == 2
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    text = "".join(tok.decode(ids) for ids, _ in reference)
    assert "When did it start?\n\nFrench Revolution" in text and "Be brief." in text
    assert "input" not in datasets.Dataset.from_list(rows).column_names  # control: the first row's keys only


def test_every_dropped_row_is_listed_with_its_file_line_and_reason(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """JSONL (blank lines count), a JSON array, CSV (a quoted cell over two lines) by line; Parquet by row."""
    no_output = {"instruction": "Say nothing.", "input": ""}
    long = {"instruction": "Repeat.", "input": "", "output": " ".join(["word"] * 300)}
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(no_output) + "\n" + json.dumps(long) + "\n")
    array = tmp_path / "b.json"
    array.write_text(json.dumps([ROWS[1], no_output, ROWS[2]], indent=1))  # items open on lines 2, 7 and 11
    csv = tmp_path / "c.csv"
    csv.write_text('instruction,input,output\n"Two\nlines.",,ok\n\nNo answer.,\n')  # the last row lacks a cell
    parquet = tmp_path / "d.parquet"
    pd.DataFrame([ROWS[3], {**ROWS[3], "output": None}, {**ROWS[2], "output": None}]).to_parquet(parquet)
    sources = [{"path": str(f)} for f in (jsonl, array, csv, parquet)]
    p = prepare(
        DataConfig(sources=tuple(SourceConfig(**s) for s in sources), format="alpaca", seq_len=128, overlong="drop"),
        str(tiny_tokenizer),
        tmp_path / "cache",
        progress=False,
    )
    listed = [json.loads(x) for x in (p.train_path.parent / "dropped.jsonl").read_text().splitlines()]
    missing = "field 'output' is missing or null"
    assert [(e["file"], e.get("line", e.get("row")), e["reason"], e["detail"]) for e in listed] == [
        (str(jsonl), 3, "null_field", missing),
        (str(jsonl), 4, "overlong", "319 tokens, data.seq_len is 128"),
        (str(array), 7, "null_field", missing),
        (str(csv), 5, "null_field", missing),
        (str(parquet), 2, "null_field", missing),
        (str(parquet), 3, "null_field", missing),
    ]
    assert p.manifest["train"]["examples_in"] == 11 and p.manifest["train"]["examples_out"] == 5
    summary = p.summary()
    assert f"dropped rows (5 of 6 shown; every one in {p.train_path.parent / 'dropped.jsonl'}):" in summary
    assert f"    {jsonl}:3: null_field ({missing})" in summary and f"    {parquet} row 2: null_field" in summary
    assert f"{parquet} row 3" not in summary  # the first few in the console; every one in the file


# ----------------------------------------------------------------------------- templates and masking


def test_alpaca_trains_through_the_tokenizers_template(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """alpaca rows are rendered by the tokenizer's own chat template (what a server applies):
    only the response and its end-of-turn EOS are trained."""
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    p = _prep(tmp_path, tiny_tokenizer, path=str(_jsonl(tmp_path / "d.jsonl", ROWS)), packing=False)
    assert p.manifest["train"]["format"] == "alpaca" and "'instruction'" in p.manifest["train"]["format_reason"]
    ds = _rows(p)
    assert ds.num_rows == len(ROWS)  # packing off: one example per row, in input order
    for ex, row in zip(ROWS, ds, strict=True):
        msgs = alpaca_messages(ex["instruction"], ex["input"]) + [{"role": "assistant", "content": ex["output"]}]
        rendered = tok.apply_chat_template(msgs, tokenize=False)
        assert "<|user|>" in rendered and "### Instruction" not in rendered
        real = row["num_real"]
        assert row["input_ids"][:real] == tok(rendered, add_special_tokens=False)["input_ids"]
        assert _trained_text(tok, row["input_ids"][:real], row["labels"][:real]) == ex["output"] + tok.eos_token
        assert all(t == tok.pad_token_id for t in row["input_ids"][real:])


def test_alpaca_template_is_the_stanford_prompt(tmp_path: Path, tiny_tokenizer: Path) -> None:
    """data.chat_template=alpaca renders the Stanford prompt (an input follows the instruction)."""
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    p = _prep(
        tmp_path, tiny_tokenizer, path=str(_jsonl(tmp_path / "d.jsonl", ROWS)), packing=False, chat_template="alpaca"
    )
    for ex, row in zip(ROWS, _rows(p), strict=True):
        instruction = f"{ex['instruction']}\n\n{ex['input']}" if ex["input"] else ex["instruction"]
        prompt = tok(alpaca_prompt(instruction, ""))["input_ids"]
        response = tok(ex["output"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        real = row["num_real"]
        assert row["input_ids"][:real] == prompt + response
        assert row["labels"][:real] == [IGNORE_INDEX] * len(prompt) + response  # BOS and prompt masked


def test_text_trains_every_token_but_the_first(tmp_path: Path, tiny_tokenizer: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    texts = ["the capital of France is Paris", "red green blue"]
    path = _jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    docs = sorted(_docs(_rows(_prep(tmp_path, tiny_tokenizer, path=str(path), format="text"))))
    expected = sorted(
        (ids, [IGNORE_INDEX] + ids[1:]) for ids in (tok(t)["input_ids"] + [tok.eos_token_id] for t in texts)
    )
    assert docs == expected


def _trained_text(tok: Any, ids: list[int], labels: list[int]) -> str:
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ids, labels, strict=False))
    return tok.decode([t for t, lab in zip(ids, labels, strict=False) if lab != IGNORE_INDEX])


@pytest.mark.parametrize("template", [None, CHAT_TEMPLATE_NO_GENERATION_TAGS], ids=["generation-tags", "prefix-render"])
def test_chat_trains_only_assistant_turns(tmp_path: Path, tiny_tokenizer: Path, template: str | None) -> None:
    """`None`: the tiny tokenizer's own template marks {% generation %}; else prefixes are rendered."""
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:2]}, {"messages": CONVERSATION[1:3]}]
    p = _prep(
        tmp_path,
        tiny_tokenizer,
        path=str(_jsonl(tmp_path / "c.jsonl", rows)),
        format="chat",
        chat_template=template,
        packing=False,
    )
    ds = _rows(p)
    # the conversation that ends with a user turn has nothing to learn
    assert p.manifest["train"]["dropped"] == {"no_trainable_tokens": 1}
    first, last = (_trained_text(tok, r["input_ids"][: r["num_real"]], r["labels"][: r["num_real"]]) for r in ds)
    eos = tok.eos_token
    assert first.replace("\n", "") == f"Paris is the capital.{eos}Rome.{eos}"
    assert last.replace("\n", "") == f"Paris is the capital.{eos}"
    # the masked part is exactly the rest of the rendered conversation
    rendered = tok.apply_chat_template(CONVERSATION, tokenize=False, chat_template=template)
    assert tok.decode(ds[0]["input_ids"][: ds[0]["num_real"]]) == rendered


def test_overlong_drop_and_truncate_are_counted(tmp_path: Path, tiny_tokenizer: Path) -> None:
    long = {"instruction": "Repeat.", "input": "", "output": " ".join(["word"] * 300)}
    huge_prompt = {"instruction": " ".join(["cat"] * 400), "input": "", "output": "ok"}
    path = _jsonl(tmp_path / "d.jsonl", ROWS + [long, huge_prompt])
    dropped = _prep(tmp_path, tiny_tokenizer, path=str(path), overlong="drop", seq_len=128)
    assert dropped.manifest["train"]["dropped"] == {"overlong": 2}
    assert dropped.manifest["train"]["examples_out"] == len(ROWS)
    cut = _prep(tmp_path, tiny_tokenizer, path=str(path), overlong="truncate", seq_len=128)
    st = cut.manifest["train"]
    # the truncated prompt-only example has no trainable token left and is dropped by reason
    assert st["dropped"] == {"no_trainable_after_truncation": 1}
    assert st["truncated"] == 1 and st["examples_out"] == len(ROWS) + 1
    assert max(_rows(cut)["num_real"]) <= 128
    assert "no_trainable_after_truncation 1" in cut.summary() and "truncated: 1" in cut.summary()


# ----------------------------------------------------------------------------- errors


def _error(tmp_path: Path, tok: Path, **kw: Any) -> str:
    with pytest.raises(DataError) as e:
        _prep(tmp_path, tok, **kw)
    return str(e.value)


def test_bad_inputs_fail_with_one_clear_sentence(tmp_path: Path, tiny_tokenizer: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n" + '{"instruction": "x", "output": \n')
    assert f"{bad}:3:" in _error(tmp_path, tiny_tokenizer, path=str(bad))

    missing = _jsonl(tmp_path / "missing.jsonl", [{"instruction": "a", "input": "", "answer": "b"}])
    for fmt in ("alpaca", "auto"):
        msg = _error(tmp_path, tiny_tokenizer, path=str(missing), format=fmt)
        assert "'output'" in msg and "fields found: instruction, input, answer" in msg and "data.output_field" in msg

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "no examples" in _error(tmp_path, tiny_tokenizer, path=str(empty))
    (tmp_path / "empty.json").write_text("[]")
    assert "no examples" in _error(tmp_path, tiny_tokenizer, path=str(tmp_path / "empty.json"))

    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps({"data": ROWS}, indent=1))
    assert "got one JSON object (keys: data)" in _error(tmp_path, tiny_tokenizer, path=str(obj))

    txt = tmp_path / "data.txt"
    txt.write_text("hello")
    msg = _error(tmp_path, tiny_tokenizer, path=str(txt))
    assert "'.txt'" in msg and ".jsonl" in msg and ".parquet" in msg

    msg = _error(tmp_path, tiny_tokenizer, path=str(tmp_path / "nope.jsonl"))
    assert "does not exist" in msg and "data.path" in msg
    msg = _error(tmp_path, tmp_path / "no-tokenizer-here", path=str(_jsonl(tmp_path / "ok.jsonl", ROWS)))
    assert "neither a local folder nor a hub model id" in msg and "data.tokenizer" in msg
    assert not any((tmp_path / "cache").iterdir())  # no failed attempt left anything behind


def test_chat_without_any_template_names_the_key(tmp_path: Path, tiny_tokenizer: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    tok.chat_template = None
    bare = tmp_path / "bare-tokenizer"
    tok.save_pretrained(bare)
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    msg = _error(tmp_path, bare, path=str(path), format="chat")
    assert "no chat template" in msg and "data.chat_template" in msg
    # ... and the key it names is the fix
    p = _prep(tmp_path, bare, path=str(path), format="chat", chat_template=CHAT_TEMPLATE_NO_GENERATION_TAGS)
    assert p.manifest["train"]["examples_out"] == 1


# ----------------------------------------------------------------------------- cache


def test_cache_reuse_and_invalidation(tmp_path: Path, tiny_tokenizer: Path) -> None:
    rows = [dict(r, text=r["instruction"] + " " + r["output"]) for r in ROWS]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    first = _prep(tmp_path, tiny_tokenizer, path=str(path))
    again = _prep(tmp_path, tiny_tokenizer, path=str(path))
    assert not first.reused and again.reused and again.fingerprint == first.fingerprint
    assert "reused cached dataset" in again.summary() and again.manifest == first.manifest
    # settings that do not change rows do not invalidate
    assert _prep(tmp_path, tiny_tokenizer, path=str(path), num_proc=2, shuffle=False).reused

    changed = {
        "seq_len": _prep(tmp_path, tiny_tokenizer, path=str(path), seq_len=128),
        "template": _prep(tmp_path, tiny_tokenizer, path=str(path), format="text"),
        "packing": _prep(tmp_path, tiny_tokenizer, path=str(path), packing=False),
        "overlong": _prep(tmp_path, tiny_tokenizer, path=str(path), overlong="drop"),
        "field": _prep(tmp_path, tiny_tokenizer, path=str(path), output_field="text"),
        "eval split": _prep(tmp_path, tiny_tokenizer, path=str(path), eval_fraction=0.25),
    }
    _jsonl(path, rows[:3])  # same path, new bytes
    changed["data bytes"] = _prep(tmp_path, tiny_tokenizer, path=str(path))
    fingerprints = {first.fingerprint}
    for what, p in changed.items():
        assert not p.reused, what
        fingerprints.add(p.fingerprint)
    assert len(fingerprints) == len(changed) + 1
    assert changed["data bytes"].manifest["train"]["examples_in"] == 3


def test_failed_prepare_leaves_nothing_complete(
    tmp_path: Path, tiny_tokenizer: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer.data import cache

    path = _jsonl(tmp_path / "d.jsonl", ROWS)

    def killed(directory: Path, manifest: dict[str, Any]) -> None:
        raise KeyboardInterrupt  # as if interrupted while committing

    monkeypatch.setattr(cache, "write_manifest", killed)
    with pytest.raises(KeyboardInterrupt):
        _prep(tmp_path, tiny_tokenizer, path=str(path))
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.undo()

    # A prepare killed outright leaves its temp dir behind: a later run removes it and builds.
    finished = subprocess.Popen(["true"])
    finished.wait()  # its pid is now dead: stands in for a killed prepare
    p = _prep(tmp_path, tiny_tokenizer, path=str(path))
    stale = tmp_path / "cache" / f"{p.fingerprint}.tmp-{socket.gethostname()}-{finished.pid}-abcd1234"
    stale.mkdir()
    (stale / "manifest.json").write_text("{}")
    # a final-named directory without a manifest is never trusted
    (tmp_path / "cache" / p.fingerprint / "manifest.json").unlink()
    again = _prep(tmp_path, tiny_tokenizer, path=str(path))
    assert not again.reused and not stale.exists()
    assert sorted(d.name for d in (tmp_path / "cache").iterdir()) == [p.fingerprint]
    assert _prep(tmp_path, tiny_tokenizer, path=str(path)).reused


# ----------------------------------------------------------------------------- eval split, summary, report


def test_eval_split_is_deterministic_and_disjoint(tmp_path: Path, tiny_tokenizer: Path) -> None:
    rows = [{"instruction": f"Say {i}.", "input": "", "output": f"{i} {i} {i}"} for i in range(40)]
    path = str(_jsonl(tmp_path / "d.jsonl", rows))
    a = _prep(tmp_path, tiny_tokenizer, path=path, eval_fraction=0.25, seed=1)
    b = _prep(tmp_path, tiny_tokenizer, "other-cache", path=path, eval_fraction=0.25, seed=1)
    c = _prep(tmp_path, tiny_tokenizer, path=path, eval_fraction=0.25, seed=2)
    assert a.manifest["eval"]["examples_in"] == 10 and a.manifest["train"]["examples_in"] == 30
    assert _rows(a, "eval")["input_ids"] == _rows(b, "eval")["input_ids"]
    train_docs = {tuple(d[0]) for d in _docs(_rows(a))}
    eval_docs = {tuple(d[0]) for d in _docs(_rows(a, "eval"))}
    assert len(train_docs) == 30 and len(eval_docs) == 10 and not train_docs & eval_docs
    assert eval_docs != {tuple(d[0]) for d in _docs(_rows(c, "eval"))}  # the seed matters
    sep = _prep(tmp_path, tiny_tokenizer, path=path, eval_path=str(_jsonl(tmp_path / "e.jsonl", ROWS)))
    assert sep.manifest["eval"]["examples_in"] == len(ROWS) and sep.manifest["train"]["examples_in"] == 40
    assert _prep(tmp_path, tiny_tokenizer, path=path).eval_path is None


def test_manifest_summary_and_plot(tmp_path: Path, tiny_tokenizer: Path, tiny_data: Path) -> None:
    p = _prep(tmp_path, tiny_tokenizer, path=str(tiny_data), seq_len=512)
    m = json.loads((p.train_path.parent / "manifest.json").read_text())
    assert m == p.manifest and m["fingerprint"] == p.fingerprint
    st = m["train"]
    ds = _rows(p)
    assert st["rows"] == ds.num_rows and st["real_tokens"] == sum(ds["num_real"])
    assert st["trainable_tokens"] == sum(ds["num_trainable"]) == int((np.array(ds["labels"]) != IGNORE_INDEX).sum())
    assert st["packing_efficiency"] == pytest.approx(st["real_tokens"] / (st["rows"] * 512))
    assert st["packing_efficiency"] > st["baseline"]["efficiency"]
    ls = st["lengths"]
    assert ls["p50"] <= ls["p90"] <= ls["p99"] <= ls["max"] and sum(ls["histogram"]["counts"]) == 400
    assert ls["suggested_seq_len"] % 64 == 0 and ls["suggested_seq_len"] >= ls["p99"]
    text = p.summary()
    for needle in ("400 examples in", "packing efficiency", "p99", "suggested seq_len", "512:", "#"):
        assert needle in text, needle
    # The plot is drawn on demand (`spotune inspect`), once per cache entry, not while preparing.
    assert not (p.train_path.parent / LENGTHS_PNG).exists()
    png = lengths_plot(p.train_path.parent, m)
    assert png == p.train_path.parent / LENGTHS_PNG and png.read_bytes()[:4] == b"\x89PNG"
    assert png.stat().st_size > 1000 and plot_lengths(m)[:4] == b"\x89PNG"
    mtime = png.stat().st_mtime_ns
    assert lengths_plot(p.train_path.parent, m) == png and png.stat().st_mtime_ns == mtime  # drawn once


def test_num_proc_gives_identical_rows(tmp_path: Path, tiny_tokenizer: Path, tiny_data: Path) -> None:
    one = _prep(tmp_path, tiny_tokenizer, "c1", path=str(tiny_data), seq_len=512)
    two = _prep(tmp_path, tiny_tokenizer, "c2", path=str(tiny_data), seq_len=512, num_proc=2)
    assert one.fingerprint == two.fingerprint and not two.reused
    assert _rows(one)["input_ids"] == _rows(two)["input_ids"] and _rows(one)["labels"] == _rows(two)["labels"]
