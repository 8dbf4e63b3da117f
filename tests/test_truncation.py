"""What `data.seq_len` loses is shown before anyone pays: the share of examples and of tokens cut
at the seq_len in use, a warning above `WARN_SHARE` naming the seq_len that holds p99, and the rule
printed with that suggestion is the rule computed (trainer/data/stats.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from trainer.config import DataConfig
from trainer.data import prepare
from trainer.data.read import DataError
from trainer.data.stats import (
    SEQ_LEN_MULTIPLE,
    SEQ_LEN_RULE,
    WARN_SHARE,
    brief_summary,
    suggest_seq_len,
    truncation,
    truncation_lines,
)
from trainer.data.template import NO_TRAINABLE_AFTER_TRUNCATION, OVERLONG, answers_cut


def test_the_seq_len_rule_printed_is_the_rule_computed() -> None:
    """The p99 of 2,317 tokens the issue met: 2,368 (the smallest multiple of 64), not 3,072."""
    assert SEQ_LEN_RULE == f"the smallest multiple of {SEQ_LEN_MULTIPLE} holding p99"
    assert suggest_seq_len(2317) == 2368
    for p99 in (1, 63, 64, 65, 168, 1000, 2317, 4096, 100_003):
        got = suggest_seq_len(p99)
        assert got % SEQ_LEN_MULTIPLE == 0 and got >= p99 and got - SEQ_LEN_MULTIPLE < p99, p99


def test_truncation_counts_every_token_seq_len_loses() -> None:
    lengths = np.array([10, 300, 260, 500, 400, 999, 50])
    status = np.array(["", "", "", OVERLONG, NO_TRAINABLE_AFTER_TRUNCATION, "null_field", ""], dtype=object)
    tr = truncation(lengths, status, 256)
    # kept and cut: 300 -> 44 lost, 260 -> 4 lost; dropped for their length: 500 + 400 whole;
    # the null_field row never met seq_len.
    assert tr == {
        "seq_len": 256,
        "examples": 6,
        "tokens": 10 + 300 + 260 + 500 + 400 + 50,
        "truncated": 2,
        "dropped": 2,
        "tokens_lost": 44 + 4 + 500 + 400,
        "max": 500,  # the longest that met seq_len (the null_field row did not)
    }


@pytest.fixture(scope="module")
def long_tailed(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Path) -> Path:
    """20 alpaca rows: 16 short, 4 with long answers (a fifth of the examples over 64 tokens)."""
    rows = [{"instruction": f"Say {i}.", "input": "", "output": f"{i}"} for i in range(16)]
    rows += [{"instruction": "Count.", "input": "", "output": " ".join(["one"] * (60 + 30 * i))} for i in range(4)]
    path = tmp_path_factory.mktemp("long") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prepare_summary_shows_what_seq_len_loses_and_warns(
    tmp_path: Path, tiny_tokenizer: Path, long_tailed: Path
) -> None:
    cut = prepare(DataConfig(path=str(long_tailed), seq_len=64), str(tiny_tokenizer), tmp_path, progress=False)
    st = cut.manifest["train"]
    tr = st["truncation"]
    # Independent count: each kept example's rendered length, from the tokenizer and its template.
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    rows = [json.loads(line) for line in long_tailed.read_text().splitlines()]
    lens = []
    for r in rows:
        turns = [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}]
        text = tok.apply_chat_template(turns, tokenize=False)
        lens.append(len(tok(text, add_special_tokens=False).input_ids))
    over = [n for n in lens if n > 64]
    assert len(over) == 4 and tr["truncated"] == 4 and tr["dropped"] == 0 and tr["examples"] == 20
    assert tr["tokens"] == sum(lens)  # the template closes each turn itself: no EOS appended
    assert tr["tokens_lost"] == sum(n - 64 for n in over)
    text = cut.summary()
    share, token_share = 4 / 20, tr["tokens_lost"] / tr["tokens"]
    assert f"at seq_len 64 (in use): 4 of 20 examples lose tokens ({share:.1%}: 4 truncated): " in text
    assert f"{tr['tokens_lost']:,} of {tr['tokens']:,} tokens in all ({token_share:.1%})" in text
    p99 = st["lengths"]["p99"]
    want = f"data.seq_len={suggest_seq_len(p99)} holds p99 ({p99:,} tokens; {SEQ_LEN_RULE})"
    assert "WARNING: " in text and want in text
    assert f"suggested seq_len: {suggest_seq_len(p99)} ({SEQ_LEN_RULE})" in text
    assert "64: 20.0% (in use)" in text
    # What `train` prints of a reused dataset carries the same lines.
    brief = brief_summary(cut.manifest, True, "somewhere")
    assert "reused cached dataset" in brief and "4 of 20 examples lose tokens" in brief and want in brief

    # Control: a seq_len that holds every example loses nothing and warns of nothing.
    whole = prepare(
        DataConfig(path=str(long_tailed), seq_len=suggest_seq_len(p99)), str(tiny_tokenizer), tmp_path, progress=False
    )
    assert whole.manifest["train"]["truncation"]["tokens_lost"] == 0
    assert "0 of 20 examples lose tokens (0.0%)" in whole.summary() and "WARNING" not in whole.summary()
    assert WARN_SHARE < share


def test_answers_cut_counts_trained_tokens_and_ends_of_turn() -> None:
    x = -100
    labels = [x, x, 5, 6, 7, x, x, 8, 9]  # two answers: positions 2-4 and 7-8
    assert answers_cut(labels, 100) == [5, 0, 2, 0]
    assert answers_cut(labels, 8) == [5, 1, 2, 1]  # the second answer's end (position 8) is cut
    assert answers_cut(labels, 4) == [5, 3, 2, 2]  # both ends cut
    assert answers_cut(labels, 0) == [5, 5, 2, 2]  # dropped: everything
    assert answers_cut(labels, 5) == [5, 2, 2, 1]  # control: the first answer ends at position 4, kept whole


def test_truncation_is_measured_in_trained_tokens_and_ends_of_turn(
    tmp_path: Path, tiny_tokenizer: Path, long_tailed: Path
) -> None:
    """At a seq_len that cuts only answers, the share of trained tokens cut is far above the share of all
    tokens, every cut answer loses its end of turn, and the warning says so and names a seq_len."""
    cut = prepare(DataConfig(path=str(long_tailed), seq_len=64), str(tiny_tokenizer), tmp_path, progress=False)
    tr = cut.manifest["train"]["truncation"]
    # Independent count: the labels of each example in full (a seq_len that cuts nothing).
    from trainer.data.template import IGNORE_INDEX, tokenize_for

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    rows = [json.loads(line) for line in long_tailed.read_text().splitlines()]
    full = tokenize_for(DataConfig(path=str(long_tailed), seq_len=100_000, format="alpaca"), tok, "x")
    out = full({k: [r[k] for r in rows] for k in rows[0]})
    trained = [[i for i, v in enumerate(lab) if v != IGNORE_INDEX] for lab in out["labels"]]
    assert tr["trained"] == sum(len(t) for t in trained)
    assert tr["trained_lost"] == sum(sum(i >= 64 for i in t) for t in trained) > 0
    assert tr["answers"] == 20 and tr["ends_lost"] == sum(t[-1] >= 64 for t in trained) == 4
    text = cut.summary()
    learnt = tr["trained_lost"] / tr["trained"]
    assert learnt > tr["tokens_lost"] / tr["tokens"]  # what the model learns loses more than the tokens say
    assert (
        f"{tr['trained_lost']:,} of {tr['trained']:,} trained tokens cut ({learnt:.1%}), 4 of 20 answers lose" in text
    )
    p99 = cut.manifest["train"]["lengths"]["p99"]
    assert f"WARNING: {learnt:.1%} of the trained tokens are cut at seq_len 64 and 4 answers lose their end" in text
    assert f"data.seq_len={suggest_seq_len(p99)} holds p99" in text
    # the same lines in what `train` prints and in the estimate's (both read the manifest's record)
    assert "4 of 20 answers lose their end of turn" in brief_summary(cut.manifest, True, "x")


def test_a_fix_always_names_a_seq_len_and_never_a_setting_already_set() -> None:
    """p99 fits but the longest does not: the fix names the seq_len that holds the longest."""
    tr = {"seq_len": 256, "examples": 100, "tokens": 10_000, "truncated": 1, "dropped": 0, "tokens_lost": 700}
    tr |= {"max": 956, "trained": 5_000, "trained_lost": 700, "answers": 100, "ends_lost": 1}
    lines = truncation_lines(tr, 200)
    assert (
        lines[-1].startswith("WARNING: 14.0% of the trained tokens")
        and "data.seq_len=960 holds every example" in lines[-1]
    )


def test_no_example_left_names_a_seq_len_and_not_the_overlong_already_set(
    tmp_path: Path, tiny_tokenizer: Path, long_tailed: Path
) -> None:
    with pytest.raises(DataError) as e:
        prepare(DataConfig(path=str(long_tailed), seq_len=8), str(tiny_tokenizer), tmp_path, progress=False)
    assert "no_trainable_after_truncation 20" in str(e.value) and "set data.seq_len=" in str(e.value)
    assert "overlong" not in str(e.value)  # it is truncate already
    with pytest.raises(DataError) as dropped:  # control: with overlong=drop, truncate is a fix to name
        prepare(
            DataConfig(path=str(long_tailed), seq_len=8, overlong="drop"), str(tiny_tokenizer), tmp_path, progress=False
        )
    assert "set data.seq_len=" in str(dropped.value) and "data.overlong=truncate" in str(dropped.value)
