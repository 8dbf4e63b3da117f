"""Preference pairs and objectives: every TRL row shape read, rendered through the model's template and
packed as a chosen and a rejected document side by side; pairs dropped or cut by reason; real chat
templates; the loss reduced per pair over the whole step (any micro-batch split, any rank count); step 1
of a fresh adapter at ln 2; the starting adapter and its checks; the config's rules and names."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
from conftest import SHARED_DATA
from transformers import AutoTokenizer

from trainer import builtin_assets
from trainer import config as C
from trainer.config import AdapterConfig, DataConfig, ModelConfig, TrainConfig
from trainer.data import DataError, prepare
from trainer.data.packed import PackedRows
from trainer.data.pairs import PROMPT_DIFFERS, tokenize_pairs_for
from trainer.data.sampler import StepSampler
from trainer.data.show import show_examples
from trainer.data.template import IGNORE_INDEX
from trainer.model.load import build
from trainer.model.objective import PAIRS, Counts
from trainer.model.preference import Preference
from trainer.model.reference import REFERENCE, InitAdapter, locate
from trainer.plan import workload
from trainer.training.batches import StepDataset, document_lengths, eval_counts, micro_batch

SKY = [{"role": "user", "content": "What colour is the sky?"}]
BLUE, GREEN = {"role": "assistant", "content": "It is blue."}, {"role": "assistant", "content": "It is green."}
SHAPES = {  # one row of each of TRL's preference shapes, all meaning the same pair
    "explicit messages": {"prompt": SKY, "chosen": [BLUE], "rejected": [GREEN]},
    "explicit strings": {"prompt": SKY[0]["content"], "chosen": BLUE["content"], "rejected": GREEN["content"]},
    # HuggingFaceH4/ultrafeedback_binarized: whole conversations, its `prompt` column repeats the user turn
    "implicit (ultrafeedback)": {"prompt": SKY[0]["content"], "chosen": [*SKY, BLUE], "rejected": [*SKY, GREEN]},
    "implicit, no prompt column": {"chosen": [*SKY, BLUE], "rejected": [*SKY, GREEN]},
}


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pairs(tok: Any, rows: list[dict[str, Any]], **cfg: Any) -> dict[str, list[Any]]:
    cfg.setdefault("seq_len", 512)
    t = tokenize_pairs_for(DataConfig(**cfg), tok, "test").settle(list(rows[0]), rows)
    return t({c: [r.get(c) for r in rows] for c in rows[0]})


def _scored(tok: Any, out: dict[str, list[Any]], i: int = 0) -> tuple[str, str]:
    labels, cut = out["labels"][i], out["chosen_length"][i]
    return tuple(tok.decode([x for x in part if x != IGNORE_INDEX]) for part in (labels[:cut], labels[cut:]))  # type: ignore[return-value]


def test_every_row_shape_scores_the_answers_after_the_same_prompt(tiny_llama: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    seen = set()
    for name, row in SHAPES.items():
        out = _pairs(tok, [row])
        assert out["status"] == [""], name
        assert _scored(tok, out) == ("It is blue.</s>", "It is green.</s>"), name  # the answer and its end of turn
        ids, cut = out["input_ids"][0], out["chosen_length"][0]
        first = [
            next(i for i, x in enumerate(lab) if x != IGNORE_INDEX)
            for lab in (out["labels"][0][:cut], out["labels"][0][cut:])
        ]
        assert ids[: first[0]] == ids[cut : cut + first[1]]  # both answers follow the same prompt tokens
        seen.add(tuple(ids))
    assert len(seen) == 1  # every shape is the same pair, token for token

    # Intel/orca_dpo_pairs: system/question/chosen/rejected strings; `auto` takes `question` as the prompt.
    orca = {"system": "Be brief.", "question": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."}
    out = _pairs(tok, [orca])
    assert _scored(tok, out) == ("Paris.</s>", "Lyon.</s>")
    assert "<|system|>\nBe brief.\n<|user|>\nCapital of France?" in tok.decode(out["input_ids"][0])
    # Raw strings with no chat template anywhere: TRL's standard form, the prompt then answer + EOS.
    bare = AutoTokenizer.from_pretrained(tiny_llama)
    bare.chat_template = None
    out = _pairs(bare, [SHAPES["explicit strings"]])
    assert _scored(bare, out) == ("It is blue.</s>", "It is green.</s>")
    assert bare.decode(out["input_ids"][0]).startswith("<s>What colour is the sky?It is blue.")


def test_drops_are_counted_by_reason_and_pairs_fit_one_row(tiny_llama: Path, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    long_answer = {"role": "assistant", "content": " ".join(["blue"] * 300)}
    rows = [
        SHAPES["implicit, no prompt column"],
        {"chosen": None, "rejected": [*SKY, GREEN]},  # null_field
        {"chosen": [BLUE], "rejected": [GREEN]},  # nothing shared: no prompt
        {"chosen": [*SKY, long_answer], "rejected": [*SKY, GREEN]},  # longer than the row
    ]
    out = _pairs(tok, rows, seq_len=64)
    assert out["status"] == ["", "null_field", "no_shared_prompt", ""]
    kept = [len(ids) for ids in out["input_ids"]]
    assert kept[3] == 64 and out["length"][3] > 64  # truncated so that both fit...
    assert out["chosen_length"][3] == 64 - len(_pairs(tok, [SHAPES["explicit messages"]])["input_ids"][0]) // 2
    assert _scored(tok, out, 3)[1] == "It is green.</s>"  # ...the short answer whole, the long one cut
    assert _pairs(tok, rows, seq_len=64, overlong="drop")["status"][3] == "overlong"

    # The prompt's last characters merge with one answer's first into a token (" Mon" + "day" is " Monday"),
    # so the two answers would follow different prompt tokens (TRL's "not a token prefix" case): refused.
    merge = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}Answer: Mon{{ m['content'] }}{{ eos_token }}"
        "{% else %}Question: {{ m['content'] }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}Answer: Mon{% endif %}"
    )
    days = {"prompt": SKY, "chosen": [{"role": "assistant", "content": "day."}]}
    assert _pairs(tok, [{**days, "rejected": [{"role": "assistant", "content": "key."}]}], chat_template=merge)[
        "status"
    ] == [PROMPT_DIFFERS]
    assert _pairs(tok, [{**days, "rejected": [{"role": "assistant", "content": "day!"}]}], chat_template=merge)[
        "status"
    ] == [""]

    # Prepared: the manifest counts every pair lost or cut, by reason.
    data = _jsonl(tmp_path / "p.jsonl", [{k: v for k, v in r.items()} for r in rows] * 2)
    p = prepare(DataConfig(path=str(data), seq_len=64), str(tiny_llama), tmp_path / "c", progress=False, pairs=True)
    train = p.manifest["train"]
    assert (train["pairs"], train["dropped"], train["truncated"]) == (4, {"no_shared_prompt": 2, "null_field": 2}, 2)
    assert "8 pairs in -> 4 kept; dropped: no_shared_prompt 2, null_field 2; truncated: 2" in p.summary()


def test_implicit_pairs_are_kept_whatever_keys_arrow_fills_into_their_turns(tiny_llama: Path, tmp_path: Path) -> None:
    """Arrow gives every turn of a column every key any turn of it has, None where absent, and chosen and
    rejected are two columns: a `name` on one rejected turn must not make the shared user turns differ."""
    from trainer.data.read import data_columns, read_rows, unpacked
    from trainer.data.rows import head

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    plain = SHAPES["implicit, no prompt column"]
    data = _jsonl(tmp_path / "p.jsonl", [{"chosen": [*SKY, BLUE], "rejected": [*SKY, {**GREEN, "name": "bot"}]}, plain])
    ds = read_rows(data)
    assert unpacked(ds[1])["rejected"][0] == SKY[0]  # JSONL rows as the file has them; Parquet's are Arrow's:
    ds = datasets.Dataset.from_list([unpacked(r) for r in ds])
    assert ds[1]["rejected"][0] == {**SKY[0], "name": None} and "name" not in ds[1]["chosen"][0]  # keys filled in
    out = tokenize_pairs_for(DataConfig(seq_len=512), tok, "test").settle(data_columns(ds), head(ds))(ds.to_dict())
    assert out["status"] == ["", ""]
    assert out["input_ids"] == [_pairs(tok, [plain])["input_ids"][0]] * 2  # the same pair as the rows as written
    # control: conversations whose user turns do differ still share no prompt
    assert _pairs(tok, [{"chosen": [*SKY, BLUE], "rejected": [{**SKY[0], "content": "Why?"}, GREEN]}])["status"] == [
        "no_shared_prompt"
    ]


def test_a_tools_column_is_rendered_in_front_of_both_answers(tiny_llama: Path, tmp_path: Path) -> None:
    """Tool-calling pairs render the template's tools header, as TRL's DPOTrainer renders a `tools` column:
    the prompt both answers follow is the template's rendering of the prompt with the tools, never scored."""
    template = (
        "{% if tools %}<|tools|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "sky", "parameters": {"type": "object", "properties": {}}}}]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    rows = [{**SHAPES["explicit messages"], "tools": json.dumps(tools)}, {**SHAPES["explicit messages"], "tools": "{"}]
    out = _pairs(tok, rows, chat_template=template)
    assert out["status"] == ["", "malformed_tools"]
    ids, labels, cut = out["input_ids"][0], out["labels"][0], out["chosen_length"][0]
    want = tok.apply_chat_template(
        SKY, tools=tools, chat_template=template, add_generation_prompt=True, return_dict=True
    )
    for part, lab in ((ids[:cut], labels[:cut]), (ids[cut:], labels[cut:])):
        assert part[: next(i for i, x in enumerate(lab) if x != IGNORE_INDEX)] == list(want["input_ids"])
    assert _scored(tok, out) == ("It is blue.</s>", "It is green.</s>")  # the header is never scored
    plain = _pairs(tok, [SHAPES["explicit messages"]], chat_template=template)  # control: no tools, no header
    assert "<|tools|>" in tok.decode(ids) and "<|tools|>" not in tok.decode(plain["input_ids"][0])
    # Prepared from a file, the column is read as pairs read it (a list of schemas, kept as JSON text).
    data = _jsonl(tmp_path / "t.jsonl", [{**SHAPES["explicit messages"], "tools": tools}])
    cfg = DataConfig(path=str(data), seq_len=512, chat_template=template)
    p = prepare(cfg, str(tiny_llama), tmp_path / "c", progress=False, pairs=True)
    assert datasets.load_from_disk(str(p.train_path))[0]["input_ids"][: len(ids)] == ids


def test_packed_rows_keep_each_pair_together_in_order(tiny_llama: Path, tmp_path: Path) -> None:
    data = builtin_assets.write_pairs(tmp_path / "pairs.jsonl", n=40)
    p = prepare(DataConfig(path=str(data), seq_len=256), str(tiny_llama), tmp_path / "c", progress=False, pairs=True)
    rows = datasets.load_from_disk(str(p.train_path))
    packed = PackedRows(p.train_path)  # what a run reads
    assert sum(rows["num_pairs"]) == 40 and max(rows["num_pairs"]) > 1
    # What a step counts is defined once: the held-out set's counts are its rows' counts taken as one step's.
    whole = Counts(
        *StepDataset(packed, StepSampler(len(rows), len(rows), 0, shuffle=False), 0, 1, 3, 1)[0].counts.tolist()
    )
    assert whole.pairs == 40 and whole.real == sum(rows["num_real"]) and whole.doc_len_sq > whole.real
    assert Counts(*eval_counts(packed).tolist()) == whole
    source = [json.loads(line) for line in data.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    found = []
    for row in rows:
        batch = micro_batch(
            *(torch.tensor([row[k]]) for k in ("input_ids", "labels", "position_ids")), [row["num_pairs"]]
        )
        bounds = batch["cu_seq_lens"].tolist()
        for k in range(row["num_pairs"]):
            (c0, c1), (r0, r1) = bounds[2 * k : 2 * k + 2], bounds[2 * k + 1 : 2 * k + 3]
            chosen = tok.decode([x for x in row["labels"][c0:c1] if x != IGNORE_INDEX], skip_special_tokens=True)
            rejected = tok.decode([x for x in row["labels"][r0:r1] if x != IGNORE_INDEX], skip_special_tokens=True)
            found.append((chosen, rejected))
        assert row["position_ids"][bounds[2 * row["num_pairs"]] :] == list(range(256 - bounds[2 * row["num_pairs"]]))
    assert sorted(found) == sorted((r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in source)
    # The estimate's attention work is the meter's: each answer a document (c**2 + r**2, not (c + r)**2)
    metered = sum(
        int((document_lengths(np.asarray(row["position_ids"][: row["num_real"]])) ** 2).sum()) for row in rows
    )
    assert workload.from_manifest(p.manifest).doc_len_sq_sum == metered
    train = {k: v for k, v in p.manifest["train"].items() if k != "doc_len_sq"}  # control: a manifest before it
    assert workload.doc_len_sq(train, 256) != metered

    # What the loss relies on is asserted where it is read: a row claiming a pair more than it holds is refused.
    row = rows[0]
    tensors = [torch.tensor([row[k]]) for k in ("input_ids", "labels", "position_ids")]
    with pytest.raises(ValueError, match="claims .* preference pair"):
        micro_batch(*tensors, [row["num_pairs"] + 1])
    batch = micro_batch(*tensors, [row["num_pairs"]])  # control
    assert len(batch["seq_lengths"]) == 2 * row["num_pairs"]
    # The loss's token counts travel as a tensor (moved with the micro-batch, asynchronously): the loss never
    # copies host values to the device itself; its split sizes are host ints.
    assert batch["seq_tokens"].dtype == torch.int64 and batch["seq_tokens"].tolist() == batch["seq_lengths"]
    assert all(type(n) is int for n in batch["seq_lengths"])


def _step_loss(
    model: Any, rows: Any, objective: Preference, world: int, micro: int
) -> tuple[float, list[torch.Tensor]]:
    """One optimizer step as the loop runs it on `world` simulated ranks (DDP averages their gradients)."""
    sampler = StepSampler(len(rows), 4, seed=0, shuffle=False)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.zeros_like(p) for p in params]
    per_rank = [StepDataset(rows, sampler, r, world, micro, 1)[0] for r in range(world)]
    counts = sum(b.counts for b in per_rank)
    loss = 0.0
    for batch in per_rank:
        for m in batch.micro:
            model.zero_grad()
            value, _ = objective.loss(model, m, counts)
            (value / (counts[PAIRS].float() / world)).backward()
            grads = [g + p.grad / world for g, p in zip(grads, params, strict=True)]
            loss += float(value.detach())
    return loss / float(counts[PAIRS]), grads


def test_the_loss_is_per_pair_over_the_step_whatever_the_split(tiny_llama: Path, tmp_path: Path) -> None:
    data = builtin_assets.write_pairs(tmp_path / "pairs.jsonl", n=24)
    p = prepare(DataConfig(path=str(data), seq_len=128), str(tiny_llama), tmp_path / "c", progress=False, pairs=True)
    rows = _uneven_step(datasets.load_from_disk(str(p.train_path)))
    model = build(ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(r=4, alpha=8, dropout=0.0))
    model.train()
    objective = Preference.of(TrainConfig(objective="dpo", sft_weight=0.5))

    # Step 1 of a fresh adapter: LoRA B = 0, the policy is the reference, every pair's loss is ln 2.
    first, _ = _step_loss(model, rows, Preference.of(TrainConfig(objective="dpo")), 1, 4)
    assert first == pytest.approx(math.log(2), abs=1e-6)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(hash(name) % 1000))

    base, grads = _step_loss(model, rows, objective, 1, 4)
    for world, micro in ((1, 1), (2, 2), (3, 1)):  # 3 ranks: uneven shares, a filler micro-batch
        loss, other = _step_loss(model, rows, objective, world, micro)
        assert loss == pytest.approx(base, rel=1e-6), (world, micro)
        for g, h in zip(grads, other, strict=True):
            torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-7)
    # Control: each micro-batch's own mean, averaged over micro-batches (the usual accumulation bug) differs.
    sampler = StepSampler(len(rows), 4, seed=0, shuffle=False)
    batch = StepDataset(rows, sampler, 0, 1, 1, 1)[0]
    means = [float(objective.loss(model, m, batch.counts)[0].detach()) / m["num_pairs"] for m in batch.micro]
    assert sum(means) / len(means) != pytest.approx(base, rel=1e-4)


def _uneven_step(rows: datasets.Dataset) -> PackedRows:
    """The rows with four holding different numbers of pairs first: the step a split could get wrong."""
    by_pairs = sorted(range(len(rows)), key=lambda i: rows[i]["num_pairs"])
    picked = [by_pairs[0], by_pairs[-1], by_pairs[len(by_pairs) // 2], by_pairs[1]]
    assert len({rows[i]["num_pairs"] for i in picked}) > 1
    return PackedRows.of(rows.select(picked + [i for i in range(len(rows)) if i not in picked]).to_dict())


def test_starting_adapter_is_checked_and_kept_as_reference(tiny_llama: Path, tmp_path: Path) -> None:
    from peft.utils import get_peft_model_state_dict

    model = build(ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(r=4, alpha=8, dropout=0.0))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, 0, 0.05)
    model.save_pretrained(tmp_path / "run" / "final")
    assert locate(str(tmp_path / "run")) == tmp_path / "run" / "final"
    (tmp_path / "unfinished" / "checkpoints").mkdir(parents=True)
    with pytest.raises(C.ConfigError, match="has not finished: point at one of its checkpoints"):
        locate(str(tmp_path / "unfinished"))
    with pytest.raises(C.ConfigError, match="its rank is 4: set adapter.r=4"):
        build(
            ModelConfig(name_or_path=str(tiny_llama)), AdapterConfig(r=8), init=InitAdapter(tmp_path / "run" / "final")
        )
    with pytest.raises(C.ConfigError, match="set adapter.target_modules"):
        build(
            ModelConfig(name_or_path=str(tiny_llama)),
            AdapterConfig(r=4, alpha=8, target_modules=("q_proj",)),
            init=InitAdapter(tmp_path / "run" / "final"),
        )

    init = InitAdapter(tmp_path / "run" / "final", reference=True)
    # A base with attention dropout, and the default adapter.dropout: a preference objective turns both off.
    base = Path(shutil.copytree(tiny_llama, tmp_path / "base"))
    (base / "config.json").write_text(
        json.dumps({**json.loads((base / "config.json").read_text()), "attention_dropout": 0.3})
    )

    def started_as(train: TrainConfig) -> torch.nn.Module:
        model_cfg = ModelConfig(name_or_path=str(base), dtype="float32", attn_implementation="sdpa")
        return build(model_cfg, AdapterConfig(r=4, alpha=8), init=init, no_dropout=C.dropout_off(train)).train()

    started = started_as(TrainConfig(objective="dpo"))
    saved = get_peft_model_state_dict(model)
    for key, value in get_peft_model_state_dict(started).items():  # the trained adapter starts as the saved one
        assert torch.equal(value, saved[key])
    trainable = {n for n, p in started.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)  # the reference copy is frozen
    rows = builtin_assets.make_pairs(6, seed=2)
    data = _jsonl(tmp_path / "p.jsonl", rows)
    p = prepare(DataConfig(path=str(data), seq_len=256), str(tiny_llama), tmp_path / "c", progress=False, pairs=True)
    packed = datasets.load_from_disk(str(p.train_path))
    objective = Preference.of(TrainConfig(objective="dpo"))
    m = micro_batch(
        *(torch.tensor(packed[0:1][k]) for k in ("input_ids", "labels", "position_ids")), packed[0:1]["num_pairs"]
    )
    counts = Counts(pairs=m["num_pairs"], chosen_tokens=1).tensor()
    loss, stats = objective.loss(started, m, counts)
    assert float(loss.detach()) / m["num_pairs"] == pytest.approx(math.log(2), abs=1e-6)  # reference == starting point
    assert stats[3] == objective.loss(started, m, counts)[1][3]  # in train mode: no draw, the same logps every time
    # Step 1's backward reaches the trained adapter only: the reference's forward left no graph to it.
    loss.backward()
    grads = {n: p.grad for n, p in started.named_parameters() if "lora_" in n}
    assert {n for n, g in grads.items() if g is not None and bool(g.abs().sum())} == trainable
    assert all(g is None for n, g in grads.items() if f".{REFERENCE}." in n) and len(grads) == 2 * len(trainable)
    # Control: with dropout kept (SFT's rule), the policy's forward at the starting point is not the reference's.
    kept = started_as(TrainConfig())
    dropped = objective.loss(kept, m, counts)[1]
    assert dropped[0] != 0 and dropped[1] != 0
    assert {getattr(mod, "attention_dropout", 0.0) for mod in kept.modules()} == {0.0, 0.3}
    assert {getattr(mod, "attention_dropout", 0.0) for mod in started.modules()} == {0.0}
    assert {n for n, p in started.named_parameters() if p.requires_grad} == trainable  # the switch back restored them
    with torch.no_grad():  # the trained copy moves, the frozen reference does not: rewards appear
        for name, param in started.named_parameters():
            if ".default." in name and "lora_B" in name:
                param.mul_(1.5)
    assert objective.loss(started, m, counts)[1][0] != 0
    assert stats[0] == 0 and stats[1] == 0
    loss_fresh, stats_fresh = objective.loss(model, m, counts)  # control: against the base, the same adapter differs
    assert stats_fresh[0] != 0 and float(loss_fresh.detach()) != pytest.approx(float(loss.detach()), abs=1e-6)


def test_config_rules_and_other_tools_names(tmp_path: Path) -> None:
    def problems(*overrides: str) -> str:
        with pytest.raises(C.ConfigError) as e:
            C.load(None, list(overrides))
        return str(e.value)

    assert "set data.format to auto or preference" in problems("train.objective=dpo", "data.format=alpaca")
    assert "set train.objective to dpo, orpo or simpo" in problems("data.format=preference")
    assert "only train.dpo_loss=robust and train.objective=simpo" in problems(
        "train.objective=dpo", "train.label_smoothing=0.1"
    )
    assert "orpo has its own SFT term" in problems("train.objective=orpo", "train.sft_weight=1")
    assert "train.beta: must be above 0" in problems("train.objective=simpo", "train.beta=0")
    C.load(None, ["train.objective=dpo", "train.dpo_loss=robust", "train.label_smoothing=0.1"])  # control: valid
    recipe = tmp_path / "lf.yaml"
    recipe.write_text("stage: dpo\npref_loss: simpo\npref_beta: 2.0\nsimpo_gamma: 0.8\n")
    t = C.load(recipe).train
    assert (t.objective, t.beta, t.simpo_gamma) == ("simpo", 2.0, 0.8)
    recipe.write_text("rl: ipo\nrl_beta: 0.3\n")
    t = C.load(recipe).train
    assert (t.objective, t.dpo_loss, t.beta) == ("dpo", "ipo", 0.3)
    assert "means train.dpo_loss='ipo', but train.dpo_loss is set to 'hinge'" in problems(
        "rl=ipo", "train.dpo_loss=hinge"
    )

    # TRL's CPO simpo and Axolotl's rl: simpo keep CPO's default cpo_alpha=1.0 SFT term; LLaMA-Factory's has none
    def sft_weight(text: str, *overrides: str) -> tuple[str, str, float]:
        recipe.write_text(text)
        t = C.load(recipe, list(overrides)).train
        return t.objective, t.dpo_loss, t.sft_weight

    assert sft_weight("loss_type: simpo\n") == ("simpo", "sigmoid", 1.0)
    assert sft_weight("rl: simpo\n") == ("simpo", "sigmoid", 1.0)
    assert sft_weight("rl: simpo\ncpo_alpha: 0.5\n") == ("simpo", "sigmoid", 0.5)
    assert sft_weight("loss_type: simpo\ntrain:\n  sft_weight: 0.0\n") == ("simpo", "sigmoid", 0.0)
    assert sft_weight("loss_type: simpo\n", "train.sft_weight=0.25") == ("simpo", "sigmoid", 0.25)
    assert sft_weight("stage: dpo\npref_loss: simpo\n") == ("simpo", "sigmoid", 0.0)  # control
    # TRL 1.x's list of losses: [sigmoid, sft] is DPO plus the SFT term; another list is answered, naming the key
    assert sft_weight("rl: dpo\nloss_type: [sigmoid, sft]\n") == ("dpo", "sigmoid", 1.0)
    recipe.write_text("rl: dpo\nloss_type: [sigmoid, bco_pair]\n")
    with pytest.raises(C.ConfigError, match=r"loss_type: spotune trains one preference loss .* a list is read only as"):
        C.load(recipe)
    # A run's structure names its objective (SFT keeps the fields its checkpoints always had).
    assert C.structural_fields(C.load(None, ["train.objective=dpo"]))["train.objective"] == "dpo"
    assert C.structural_fields(C.load(None))["train.objective"] is None


def test_inspect_shows_prompt_and_both_answers_marked(tiny_llama: Path, tmp_path: Path, tiny_data: Path) -> None:
    data = _jsonl(tmp_path / "p.jsonl", [SHAPES["implicit (ultrafeedback)"]])
    shown = show_examples(DataConfig(path=str(data)), str(tiny_llama), 1, pairs=True)
    assert "prompt:\n<s><|user|>\nWhat colour is the sky?\n<|assistant|>\n\nchosen:\n[[It is blue.</s>]]" in shown
    assert "rejected:\n[[It is green.</s>]]" in shown
    # SFT on pair data says what to set; pairs asked of SFT data name the columns.
    with pytest.raises(DataError, match="set train.objective=dpo"):
        show_examples(DataConfig(path=str(data)), str(tiny_llama), 1)
    with pytest.raises(DataError, match="data.chosen_field"):
        show_examples(DataConfig(path=str(tiny_data)), str(tiny_llama), 1, pairs=True)


@pytest.mark.skipif(not (SHARED_DATA / "tokenizers").is_dir(), reason="the shared tokenizers are not in this checkout")
@pytest.mark.parametrize(
    "name", ["qwen2.5-instruct", "qwen3", "llama-3.1-instruct", "mistral-7b-instruct-v0.3", "gemma-3-it"]
)
def test_real_templates_score_the_answer_and_its_end_of_turn(name: str) -> None:
    tok = AutoTokenizer.from_pretrained(SHARED_DATA / "tokenizers" / name)
    orca = {"system": "Be brief.", "question": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon, I think."}
    think = "<think>\n\n</think>\n\n" if name == "qwen3" else ""  # Qwen3's empty think block is the model's to write
    for row in (SHAPES["implicit (ultrafeedback)"], orca):
        out = _pairs(tok, [row])
        assert out["status"] == [""]
        ends = []
        for text, answer in zip(_scored(tok, out), (row["chosen"], row["rejected"]), strict=True):
            answer = answer if isinstance(answer, str) else answer[-1]["content"]
            head, _, end = text.partition(answer)
            assert head == think and end in ("</s>", "<|im_end|>", "<|eot_id|>", "<end_of_turn>"), (text, answer)
            ends.append(end)
        assert ends[0] == ends[1]  # both answers end their turn alike, and the end is scored
    # Mistral v0.3 serves the system prompt in the last [INST]: both answers follow it there.
    if name == "mistral-7b-instruct-v0.3":
        assert "Be brief.\n\nCapital of France?[/INST]" in tok.decode(_pairs(tok, [orca])["input_ids"][0])


def test_a_hub_style_folder_its_pref_splits_and_a_mix(tiny_llama: Path, tmp_path: Path) -> None:
    """HuggingFaceH4/ultrafeedback_binarized's layout (a card naming train_prefs/test_prefs, whole
    conversations as chosen/rejected, a `messages` column SFT would read) read as pairs by `auto`, mixed
    with an Intel/orca_dpo_pairs-shaped file whose prompt column is named per source."""
    import pandas as pd

    folder = tmp_path / "ultrafeedback"
    (folder / "data").mkdir(parents=True)
    card = "".join(f"  - split: {s}\n    path: data/{s}-*\n" for s in ("train_prefs", "test_prefs", "train_sft"))
    (folder / "README.md").write_text(f"---\nconfigs:\n- config_name: default\n  data_files:\n{card}---\n")
    row = {"prompt": SKY[0]["content"], "chosen": [*SKY, BLUE], "rejected": [*SKY, GREEN], "messages": [*SKY, BLUE]}
    for split, n in (("train_prefs", 5), ("test_prefs", 3), ("train_sft", 7)):
        pd.DataFrame([{**row, "score_chosen": 8.0}] * n).to_parquet(folder / "data" / f"{split}-00000-of-00001.parquet")
    orca = _jsonl(
        tmp_path / "orca.jsonl",
        [{"system": "", "ask": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."}] * 4,
    )
    cfg = C.load(
        None, ["train.objective=dpo", f"data.path={folder}", "data.split=train_prefs", "data.eval_split=test_prefs"]
    ).data
    p = prepare(cfg, str(tiny_llama), tmp_path / "c", progress=False, pairs=True)
    assert (p.manifest["train"]["pairs"], p.manifest["eval"]["pairs"]) == (5, 3)
    assert (
        p.manifest["train"]["format"] == "preference" and "whole conversations" in p.manifest["train"]["format_reason"]
    )
    mix = C.load(
        None,
        [
            "train.objective=dpo",
            f"data.sources=[{{path: {folder}, split: train_prefs}}, {{path: {orca}, fields: {{prompt: ask}}}}]",
        ],
    ).data
    p = prepare(mix, str(tiny_llama), tmp_path / "c", progress=False, pairs=True)
    assert [s["examples_out"] for s in p.manifest["train"]["sources"]] == [5, 4]


def test_the_estimate_counts_the_reference_forward_and_the_frozen_adapter() -> None:
    """`spotune estimate` of a DPO run: the reference's forward on top of the step's FLOPs (and so its
    hours at an assumed MFU), and the frozen copy of a starting adapter in its memory."""
    from trainer.cli import world
    from trainer.model import flops
    from trainer.plan.models import load_config

    base = ["model.name_or_path=Qwen/Qwen2.5-7B-Instruct", "train.global_batch_size=8", "train.micro_batch_size=1"]
    sft = world.estimate_for_run(C.load(None, base), tokens=2e6, gpu="H100-SXM")
    dpo = world.estimate_for_run(C.load(None, [*base, "train.objective=dpo"]), tokens=2e6, gpu="H100-SXM")
    run = sft["run"]
    shape = flops.model_shape(load_config("Qwen/Qwen2.5-7B-Instruct"))
    doc_sq = run["steps"] * run["global_batch_rows"] * run["seq_len"] ** 2  # `--tokens`: a row is one document
    reference = flops.reference_forward_flops(shape, run["real_tokens"], doc_sq, run["trainable_tokens"])
    assert dpo["run"]["train_flops"] == pytest.approx(run["train_flops"] + reference, rel=1e-12)
    assert 1.3 < dpo["run"]["train_flops"] / run["train_flops"] < 1.6  # about half the LoRA step again
    hours = [e["options"][0]["compute_hours"]["expected"] for e in (sft, dpo)]
    assert hours[1] / hours[0] == pytest.approx(dpo["run"]["train_flops"] / run["train_flops"], rel=1e-9)
    assert dpo["memory_gib"]["adapter"] == sft["memory_gib"]["adapter"]  # a fresh adapter: nothing frozen
    started = C.load(None, [*base, "train.objective=dpo", "adapter.init_from=runs/sft"])
    frozen = world.estimate_for_run(started, tokens=2e6, gpu="H100-SXM")["memory_gib"]
    assert frozen["adapter"] == pytest.approx(2 * sft["memory_gib"]["adapter"])
    # The meter's MFU counts the same forward: a DPO step's FLOPs are SFT's plus the reference's; ORPO has none.
    config = load_config("Qwen/Qwen2.5-7B-Instruct")
    counts = (8192.0, 8192.0 * 512, 3000.0)  # real tokens, sum of squared document lengths, labelled tokens
    # One answer to "does this objective run a reference?", which the step, the meter and the estimate read.
    assert [o for o in ("sft", "dpo", "orpo", "simpo") if C.runs_reference(o)] == ["dpo"]
    assert Preference.of(TrainConfig(objective="dpo")).needs_reference
    assert not Preference.of(TrainConfig(objective="orpo")).needs_reference
    plain = flops.meter_flops_fn(config, 10**7)
    with_reference = flops.meter_flops_fn(config, 10**7, reference=C.runs_reference("dpo"))
    reference_free = flops.meter_flops_fn(config, 10**7, reference=C.runs_reference("orpo"))
    assert plain is not None and with_reference is not None and reference_free is not None
    assert with_reference(*counts) == pytest.approx(plain(*counts) + flops.reference_forward_flops(shape, *counts))
    assert reference_free(*counts) == plain(*counts)


def test_the_console_line_shows_reward_accuracy_and_margin() -> None:
    from trainer.training.console import Console

    console = Console(10, bar=False, is_main=True)
    line = console.step_line(3, {"loss": 0.61, "rewards/accuracies": 0.75, "rewards/margins": 0.0123})
    assert line.startswith("spotune: step 3/10 loss 0.6100 | reward acc 0.75 margin 0.0123")
    assert "reward" not in console.step_line(3, {"loss": 0.61})  # SFT: unchanged


def test_a_preference_run_serves_the_end_of_turn_it_trains(tiny_llama: Path) -> None:
    """final/'s generation config stops where pairs were trained to end: the template's end of turn for
    conversations (as SFT on messages), EOS for raw string pairs (no template renders them)."""
    from trainer.data.template import end_of_turn_ids

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert end_of_turn_ids(tok, None, "preference") == end_of_turn_ids(tok, None, "messages") != []
    tok.chat_template = None
    assert end_of_turn_ids(tok, None, "preference") == [tok.eos_token_id]
    assert end_of_turn_ids(tok, None, "messages") == []  # control: untemplated conversations serve no end


def test_an_adapter_of_another_base_or_revision_is_refused_naming_both(tiny_llama: Path, tmp_path: Path) -> None:
    """A starting adapter must have been trained on `model.*`: one of another base of the same shape (every
    weight fits) or of another revision is refused with both named, exit 2; peft's record decides for a
    bare adapter folder, the run's config for a spotune run's final/ or checkpoint."""
    import yaml

    from trainer.exit_codes import EXIT_BAD_INPUT, code_for
    from trainer.training.inputs import init_adapter

    model = build(ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(r=4, alpha=8))
    model.save_pretrained(tmp_path / "adapter")  # peft records the base it was built on
    other = Path(shutil.copytree(tiny_llama, tmp_path / "other-base"))  # the same shape: another model to spotune

    def started(init_from: Path, *overrides: str) -> InitAdapter | None:
        base = [f"output_dir={tmp_path / 'run'}", "train.objective=dpo", f"adapter.init_from={init_from}"]
        return init_adapter(C.load(None, [*base, "adapter.r=4", "adapter.alpha=8", *overrides]))

    init = started(tmp_path / "adapter", f"model.name_or_path={tiny_llama}")  # control: its own base
    assert init is not None and init.path == tmp_path / "adapter" and init.reference
    with pytest.raises(C.ConfigError) as e:
        started(tmp_path / "adapter", f"model.name_or_path={other}")
    assert f"the adapter was trained on '{tiny_llama}'" in str(e.value)
    assert f"this run's model.name_or_path is '{other}'; set model.name_or_path={tiny_llama}" in str(e.value)
    assert code_for(e.value) == EXIT_BAD_INPUT

    sft = tmp_path / "sft"  # a spotune run: its config.yaml says the base and the revision it trained on
    shutil.copytree(tmp_path / "adapter", sft / "final")
    (sft / "config.yaml").write_text(yaml.safe_dump({"model": {"name_or_path": "org/base", "revision": "abc123"}}))
    with pytest.raises(C.ConfigError) as e:
        started(sft, "model.name_or_path=org/base")
    assert "at revision 'abc123'" in str(e.value) and "this run's model.revision is 'main'" in str(e.value)
    assert str(sft / "config.yaml") in str(e.value)
    assert started(sft, "model.name_or_path=org/base", "model.revision=abc123") is not None  # control


def test_the_runs_copy_of_the_starting_adapter_survives_a_kill_inside_its_publish(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The run keeps its own copy of `adapter.init_from` (`init_adapter/`, published by renaming the old copy aside,
    then the new one in). Killed between the two renames, the only copy has a temp name; the path it came from may
    be gone by the next start (another machine's disk). The next start puts the copy back and trains from it; a
    kill while copying leaves an unfinished copy, which goes. Before, the start looked for the path and failed."""
    from types import SimpleNamespace

    from trainer import atomic
    from trainer.model.reference import INIT_DIR
    from trainer.training.inputs import init_adapter, keep_init_adapter

    model = build(ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(r=4, alpha=8))
    model.save_pretrained(tmp_path / "adapter")
    base = [f"output_dir={tmp_path / 'run'}", "train.objective=dpo", f"adapter.init_from={tmp_path / 'adapter'}"]
    cfg = C.load(None, [*base, "adapter.r=4", "adapter.alpha=8", f"model.name_or_path={tiny_llama}"])
    node = SimpleNamespace(is_local_main_process=True, wait_for_everyone=lambda: None)
    proc: Any = SimpleNamespace(is_main=True, remote=SimpleNamespace(reachable=False), accelerator=node)
    keep_init_adapter(cfg, proc)
    kept = tmp_path / "run" / INIT_DIR
    weights = (kept / "adapter_model.safetensors").read_bytes()
    kept.rename(atomic.temp_sibling(kept, atomic.REPLACED))  # killed inside publish_dir
    unfinished = atomic.temp_sibling(kept, "copy")
    unfinished.mkdir()
    shutil.rmtree(tmp_path / "adapter")  # the path is gone: the temp-named copy is the only one
    keep_init_adapter(cfg, proc)
    assert (kept / "adapter_model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in kept.parent.iterdir() if p.name.startswith(INIT_DIR)) == [INIT_DIR]
    init = init_adapter(cfg)
    assert init is not None and init.path == kept
    # Control: with no copy anywhere (nothing moved aside either), the start names the missing path.
    shutil.rmtree(kept)
    with pytest.raises(C.ConfigError, match="adapter.init_from: no adapter"):
        keep_init_adapter(cfg, proc)


@pytest.mark.parametrize("mean", [0.0, -1e-9])
def test_orpo_has_a_finite_loss_and_gradient_at_a_mean_log_prob_of_0_and_just_below(mean: float) -> None:
    """Both torch.where branches of log(1 - exp(x)) are evaluated and backpropagated: each must be finite on
    every input, or 0 x inf turns the step's gradient into NaN (and the loop skips the step)."""
    tokens = torch.tensor([3.0, 5.0, 4.0, 2.0])
    logps = torch.tensor([mean * 3, -4.0, -2.0, -1.0], requires_grad=True)  # pair 1's chosen answer: certain
    losses, *_ = Preference("orpo", beta=0.1).pair_terms(logps, tokens, None)
    losses.sum().backward()
    assert logps.grad is not None
    assert torch.isfinite(losses).all() and torch.isfinite(logps.grad).all()
    assert logps.grad[1] != 0 and logps.grad[2] != 0  # the other answers still get their push
    # Control: away from the edge, both branches give log(1 - exp(x)) itself.
    from trainer.model.preference import _log1mexp

    x = torch.tensor([-0.1, -0.5, -1.0, -5.0, -40.0], dtype=torch.float64)
    exact = torch.tensor([math.log1p(-math.exp(v)) for v in x.tolist()], dtype=torch.float64)
    torch.testing.assert_close(_log1mexp(x), exact, rtol=1e-12, atol=0)


def test_simpo_outside_its_papers_regime_is_said() -> None:
    from trainer.model.preference import regime_notes

    (note,) = regime_notes(TrainConfig(objective="simpo"))  # TRL's CPO defaults: beta 0.1, gamma 0.5
    assert "train.beta=0.1 and train.simpo_gamma=0.5 (gamma/beta 5) are outside SimPO's published regime" in note
    assert "train.beta=2.5 train.simpo_gamma=1.375" in note
    assert regime_notes(TrainConfig(objective="simpo", beta=2.5, simpo_gamma=1.375)) == []  # the paper's
    assert regime_notes(TrainConfig(objective="simpo", beta=2.0, simpo_gamma=4.0))  # gamma/beta 2: said
    assert regime_notes(TrainConfig(objective="dpo")) == []  # DPO's beta 0.1 is its own regime


def test_the_keys_trl_users_carry_are_answered() -> None:
    def answer(key: str, value: str) -> str:
        with pytest.raises(C.ConfigError) as e:
            C.load(None, ["train.objective=dpo", f"{key}={value}"])
        return str(e.value)

    assert "computes the DPO reference in the same step" in answer("precompute_ref_log_probs", "true")
    assert "with loss_weights [a, b] set train.sft_weight=b/a" in answer("loss_weights", "[1.0,0.5]")
    assert "sample the model's answers after training with `spotune chat RUN_DIR`" in answer(
        "generate_during_eval", "true"
    )


def test_each_step_logs_its_pairs() -> None:
    """Packing puts a varying number of pairs in a row: the metrics row says how many the step trained on."""
    objective = Preference.of(TrainConfig(objective="dpo"))
    stats = [0.5, -0.5, 3.0, -10.0, -12.0]
    assert objective.report(stats, Counts(pairs=5))["pairs"] == 5.0
    assert objective.report(stats, Counts(pairs=4))["pairs"] == 4.0


def test_the_estimate_says_the_mean_pairs_per_step(tiny_llama: Path, tmp_path: Path) -> None:
    """`spotune estimate` of a preference run: the mean pairs a step of its packed rows trains on, from the
    prepared manifest (exact) and from a sample; none for SFT."""
    from trainer.cli import world
    from trainer.plan.table import format_estimate

    data = builtin_assets.write_pairs(tmp_path / "pairs.jsonl", n=24)
    base = [
        f"model.name_or_path={tiny_llama}",
        f"data.path={data}",
        "data.seq_len=256",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"output_dir={tmp_path / 'run'}",
        "train.global_batch_size=4",
        "train.objective=dpo",
    ]
    sampled = world.estimate_for_run(C.load(None, base), gpu="H100-SXM", throughput=1000.0)
    p = prepare(C.load(None, base).data, str(tiny_llama), tmp_path / "cache", progress=False, pairs=True)
    exact = world.estimate_for_run(C.load(None, base), gpu="H100-SXM", throughput=1000.0)
    assert (sampled["data"]["source"], exact["data"]["source"]) == ("sample", "manifest")
    train = p.manifest["train"]
    mean = 4 * train["pairs"] / train["rows"]
    assert mean > 4  # several pairs per row: the figure is not the rows per step
    assert exact["run"]["pairs_per_step"] == pytest.approx(mean, rel=1e-12)
    assert sampled["run"]["pairs_per_step"] == pytest.approx(mean, rel=1e-12)  # the whole set is the sample
    assert f", {mean:.1f} pairs per step (mean)" in format_estimate(exact)
    # KTO's units are single answers (TRL's unpaired rows: each pair as a thumbs-up and a thumbs-down row)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    unpaired = tmp_path / "unpaired.jsonl"
    unpaired.write_text(
        "".join(
            json.dumps({"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}) + "\n"
            for r in rows
            for side in ("chosen", "rejected")
        )
    )
    kto = [*base[:1], f"data.path={unpaired}", *base[2:-1], "train.objective=kto"]
    answers = world.estimate_for_run(C.load(None, kto), gpu="H100-SXM", throughput=1000.0)
    assert answers["run"]["pairs_are"] == "answers" and exact["run"]["pairs_are"] == "pairs"
    assert " answers per step (mean)" in format_estimate(answers) and " pairs per step" not in format_estimate(answers)


def test_a_run_refuses_prepared_pairs_with_identical_answers(tiny_llama: Path, tmp_path: Path) -> None:
    """A pair whose answers are the same tokens has no DPO gradient but would count as a pair of its step and
    as a wrong ranking: prepared rows that hold one (a cache of a version that kept them) are refused, exit 2."""
    from trainer.exit_codes import EXIT_BAD_INPUT, code_for
    from trainer.training.batches import identical_pairs
    from trainer.training.run import refuse_identical_pairs

    packed = PackedRows.of(
        {
            "input_ids": [
                [1, 2, 3, 1, 2, 4, 0, 0, 0, 0],
                [1, 2, 3, 1, 2, 3, 5, 6, 5, 7],
                [5, 6, 5, 7, 1, 2, 3, 1, 2, 3],
            ],
            "position_ids": [
                [0, 1, 2, 0, 1, 2, 0, 1, 2, 3],
                [0, 1, 2, 0, 1, 2, 0, 1, 0, 1],
                [0, 1, 0, 1, 0, 1, 2, 0, 1, 2],
            ],
            "num_pairs": [1, 2, 2],
        }
    )
    assert identical_pairs(packed) == [1, 2]  # row 0's answers differ in their last token: kept
    with pytest.raises(DataError) as e:
        refuse_identical_pairs(packed, tmp_path / "train")
    assert "2 packed row(s) hold a pair whose chosen and rejected answers are the same tokens (first: row 1)" in str(
        e.value
    )
    assert code_for(e.value) == EXIT_BAD_INPUT
    # Control: real prepared pairs pass.
    data = builtin_assets.write_pairs(tmp_path / "pairs.jsonl", n=12)
    p = prepare(DataConfig(path=str(data), seq_len=256), str(tiny_llama), tmp_path / "c", progress=False, pairs=True)
    assert identical_pairs(PackedRows(p.train_path)) == []
