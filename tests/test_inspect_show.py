"""`spotune inspect --show N`: examples as the model sees them, trained text marked; the HTML form."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from test_data_sources import ALPACA, COMMIT_A, _hub_repo, fake_hub  # noqa: F401 (fake_hub: a fixture)
from transformers import AutoTokenizer

from trainer.cli.main import main
from trainer.data.show import ANSI_ON, example_html, example_text
from trainer.data.template import IGNORE_INDEX

ROWS = [
    {"conversations": [{"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris"}]},
    {"conversations": [{"from": "human", "value": "Say <b> & stop"}, {"from": "gpt", "value": "<b> & ok"}]},
    {"conversations": [{"from": "human", "value": "Only a question"}]},
]


def test_inspect_show_marks_trained_text(tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    argv = ["inspect", f"model.name_or_path={tiny_llama}", f"data.path={data}", f"output_dir={tmp_path / 'run'}"]
    assert main([*argv, "data.seq_len=128", "--show", "3"]) == 0
    out = capsys.readouterr().out
    assert (
        "format sharegpt (column 'conversations' holds turns of from/value), chat template: the tokenizer's own" in out
    )
    assert "<|user|>\nCapital of France?\n<|assistant|>\n[[Paris</s>]]\n" in out  # the user turn is not marked
    assert "[[<b> & ok</s>]]" in out
    assert f"--- {data}:3: dropped (no_trainable_tokens: no token to train" in out  # its file and line
    assert out.count("]]") == 1 + 2 and ANSI_ON not in out  # the legend, two answers; not a terminal: no colour


def test_inspect_draws_the_length_plot_once_and_says_why_when_it_cannot(
    tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture
) -> None:
    """`train` prepares without drawing lengths.png; `inspect` draws it into the cache entry once, and
    names the reason when the entry is read-only (a shared data.cache_dir)."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]) * 4)
    cache = tmp_path / "cache"
    argv = [f"model.name_or_path={tiny_llama}", f"data.path={data}", "data.seq_len=128", f"data.cache_dir={cache}"]
    assert main(["prepare", *argv, f"output_dir={tmp_path / 'run'}"]) == 0
    (entry,) = [d for d in cache.iterdir() if (d / "manifest.json").is_file()]
    assert not (entry / "lengths.png").exists()  # prepare (and so train) spends nothing on the picture
    capsys.readouterr()
    entry.chmod(0o555)
    try:
        assert main(["inspect", *argv, f"output_dir={tmp_path / 'run'}"]) == 0
        said = capsys.readouterr().out
        if os.geteuid() != 0:  # root writes into a read-only folder anyway
            assert f"length plot: none (cannot write {entry / 'lengths.png'}: Permission denied)" in said
    finally:
        entry.chmod(0o755)
    assert main(["inspect", *argv, f"output_dir={tmp_path / 'run'}"]) == 0
    assert f"length plot: {entry / 'lengths.png'}\n" in capsys.readouterr().out
    assert (entry / "lengths.png").read_bytes()[:4] == b"\x89PNG"


def test_example_html_and_colour(tiny_tokenizer: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    prompt, answer = tok("Say <b>:")["input_ids"], tok(" <b> & ok", add_special_tokens=False)["input_ids"]
    ids, labels = prompt + answer, [IGNORE_INDEX] * len(prompt) + answer
    page = example_html(tok, ids, labels)
    assert (
        page
        == '<pre class="spotune-example">&lt;s&gt;Say &lt;b&gt;:<mark class="trained"> &lt;b&gt; &amp; ok</mark></pre>'
    )
    assert example_text(tok, ids, labels, color=True) == f"<s>Say <b>:{ANSI_ON} <b> & ok\x1b[0m"
    # control: a label shifted by one marks another text
    assert example_html(tok, ids, [IGNORE_INDEX, *labels[:-1]]) != page


def test_inspect_show_reads_every_source_of_a_mix_as_prepare_does(
    tmp_path: Path,
    tiny_llama: Path,
    fake_hub: Any,  # noqa: F811
    capsys: pytest.CaptureFixture,
) -> None:
    """A hub dataset (read from the cache, offline) and a local folder, each in its own format: `--show`
    shows both, not the default `data.path` (the built-in rows) that `data.sources` leaves unset, and
    each source's rows as they train: after its `rows` choice."""
    _hub_repo(fake_hub)
    folder = tmp_path / "chats"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"name_or_path": str(tiny_llama)},
                "data": {
                    "seq_len": 128,
                    "sources": [
                        {"path": "org/instruct", "format": "alpaca", "rows": 4},
                        {"path": str(folder), "format": "sharegpt"},
                    ],
                },
                "output_dir": str(tmp_path / "run"),
            }
        )
    )
    assert main(["inspect", str(recipe), "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert f"data.sources[0] hf://datasets/org/instruct@{COMMIT_A}: format alpaca" in out
    assert f"data.sources[1] {folder}: format sharegpt" in out
    first = int(np.sort(np.random.default_rng([0, 0]).permutation(len(ALPACA))[:4])[0])  # sources.choose's rule
    assert "[[Paris</s>]]" in out and f"{ALPACA[first]['instruction']}\n" in out
    assert first != 0 and f"{ALPACA[0]['instruction']}\n" not in out  # control: the file's first row does not train
    assert out.count(" row ") == 1 and out.count(f"{folder / 'train.jsonl'}:1:") == 1  # one row of each source
    # The control: the built-in dataset's rows, which the old `--show` printed for a mix, are absent.
    from trainer import builtin_assets

    builtin = [
        json.loads(x) for x in Path(builtin_assets.resolve_data("builtin:tiny-instruct")).read_text().splitlines()
    ]
    assert builtin[0]["output"] not in out
