"""KTO on unpaired feedback: TRL's prompt/completion/label rows read (bad rows counted drops by reason), each
answer packed beside its KL sequence (prompt i with the previous row's completion, TRL's rotation), and the
loss equal to TRL's KTOTrainer on the same adapter and rows; the keys other tools use; a resumed run
bit-identical to a straight one.

The TRL comparison evaluates one batch holding every row in both trainers (TRL's per_device batch = the
rows, spotune's micro-batch = every packed row), where both define the KL sequences and the reference point
z0 the same way; the test first checks that both score the same tokens. Controls: the labels flipped and a
beta off by 10% move the loss and the rewards beyond the tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer import builtin_assets
from trainer import config as C
from trainer.config import AdapterConfig, DataConfig, ModelConfig, TrainConfig
from trainer.data import DataError, prepare
from trainer.data.unpaired import balance_note, tokenize_unpaired_for, with_kl
from trainer.model.load import build
from trainer.model.preference import Kto
from trainer.training import run
from trainer.training.loop import make_evaluator

# The built-in template without the newline after an answer's EOS (as tests/test_preference_trl.py): TRL
# scores everything after the prompt, spotune an answer and its end of turn; here both are the same tokens.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}"
    "{{ eos_token }}{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROWS = 11
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")


def unpaired_rows(n: int, seed: int = 11) -> list[dict[str, Any]]:
    """TRL's unpaired conversational rows: the right answer (desirable) or a wrong one (undesirable)."""
    out = []
    for k, pair in enumerate(builtin_assets.make_pairs(n, seed=seed)):
        good = k % 3 != 1  # 2 of 3 desirable: unbalanced, as real feedback is
        out.append({"prompt": pair["prompt"], "completion": pair["chosen" if good else "rejected"], "label": good})
    return out


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def adapter(tiny_llama: Path) -> dict[str, torch.Tensor]:
    """Random LoRA weights (A and B, non-zero: the policy differs from the reference), peft's saved keys."""
    from peft.utils import get_peft_model_state_dict

    model = build(ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(r=4, alpha=8, dropout=0.0))
    gen = torch.Generator().manual_seed(5)  # a seed whose KL estimate is above 0 (not clamped): z0 is compared
    return {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in get_peft_model_state_dict(model).items()}


def _spotune(tiny_llama: Path, adapter: dict[str, torch.Tensor], rows: list[dict[str, Any]], tmp: Path, **train: Any):
    from accelerate import Accelerator
    from peft.utils import set_peft_model_state_dict

    from trainer.data.packed import PackedRows

    data = _jsonl(tmp / "kto.jsonl", rows)
    prepared = prepare(
        DataConfig(path=str(data), seq_len=256, chat_template=TEMPLATE),
        str(tiny_llama),
        tmp / "c",
        progress=False,
        pairs=True,
    )
    train_info = prepared.manifest["train"]
    assert (train_info["desirable"], train_info["undesirable"]) == (
        sum(r["label"] for r in rows),
        sum(not r["label"] for r in rows),
    )
    packed = PackedRows(prepared.train_path)
    assert (
        max(packed.take(slice(None))["num_pairs"]) > 1
    )  # several units share a row: the packed path is what is compared
    model = build(ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(r=4, alpha=8, dropout=0.0))
    set_peft_model_state_dict(model, adapter)
    out: dict[str, float] = {}
    evaluate = make_evaluator(
        packed,
        model,
        Accelerator(cpu=True),
        len(packed),
        lambda loss, s, extras: out.update(extras, loss=loss),
        Kto.of(TrainConfig(objective="kto", **train)),
    )
    assert evaluate is not None
    evaluate()
    return out


def _trl(tiny_llama: Path, adapter: dict[str, torch.Tensor], rows: list[dict[str, Any]], tmp: Path, **args: Any):
    from datasets import Dataset
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = TEMPLATE
    ds = Dataset.from_list(rows)
    config = KTOConfig(
        output_dir=str(tmp / "trl"),
        per_device_train_batch_size=len(rows),  # TRL rotates the KL completions within blocks of this size
        per_device_eval_batch_size=len(rows),  # one batch: z0 and the mean over every row
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=None,
        save_strategy="no",
        logging_strategy="no",
        **args,
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = KTOTrainer(
        base, args=config, train_dataset=ds, eval_dataset=ds, processing_class=tokenizer, peft_config=peft_config
    )
    set_peft_model_state_dict(trainer.model, adapter)  # the reference stays the base: adapters disabled
    return trainer, trainer.evaluate()


def test_kto_evaluation_equals_trl(tiny_llama: Path, adapter: dict[str, torch.Tensor], tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer

    rows = unpaired_rows(ROWS)
    trainer, theirs = _trl(tiny_llama, adapter, rows, tmp_path, beta=0.1, desirable_weight=1.3, undesirable_weight=0.8)
    # Both score the same tokens: TRL's prompt + completion ids and its KL sequences are spotune's.
    tok = tokenize_unpaired_for(
        DataConfig(chat_template=TEMPLATE, seq_len=512), AutoTokenizer.from_pretrained(tiny_llama), "t"
    )
    tok = tok.settle(list(rows[0]), rows)
    ours = with_kl(Dataset.from_dict(tok({c: [r[c] for r in rows] for c in rows[0]})), tok.lengths, 512, "truncate")
    for i, ex in enumerate(trainer.eval_dataset):
        ids, labels, cut = ours["input_ids"][i], ours["labels"][i], ours["chosen_length"][i]
        assert ids == ex["prompt_ids"] + ex["completion_ids"] + ex["prompt_ids"] + ex["KL_completion_ids"]
        assert [x for x in labels[:cut] if x != -100] == ex["completion_ids"]
        assert [x for x in labels[cut:] if x != -100] == ex["KL_completion_ids"]
        assert ours["desirable"][i] == int(ex["label"])

    mine = _spotune(
        tiny_llama, adapter, rows, tmp_path / "spotune", beta=0.1, desirable_weight=1.3, undesirable_weight=0.8
    )
    print(
        f"|spotune - TRL| eval loss: {abs(mine['loss'] - theirs['eval_loss']):.3g} ({mine['loss']:.7f} vs {theirs['eval_loss']:.7f})"
    )
    assert mine["loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5, abs=1e-6)
    for name in FIGURES:
        assert abs(theirs[f"eval_{name}"]) > 1e-4, name  # non-trivial: the policy is not the reference, z0 > 0
        assert mine[name] == pytest.approx(theirs[f"eval_{name}"], rel=1e-4, abs=1e-6), name

    # Controls: each can fail. The labels flipped move the loss and the rewards...
    flipped = _spotune(
        tiny_llama,
        adapter,
        [dict(r, label=not r["label"]) for r in rows],
        tmp_path / "flip",
        beta=0.1,
        desirable_weight=1.3,
        undesirable_weight=0.8,
    )
    assert flipped["loss"] != pytest.approx(theirs["eval_loss"], rel=1e-3)
    assert flipped["rewards/chosen"] != pytest.approx(theirs["eval_rewards/chosen"], rel=1e-3)
    # ...and a beta off by 10% moves the loss beyond the tolerance.
    off = _spotune(
        tiny_llama, adapter, rows, tmp_path / "beta", beta=0.11, desirable_weight=1.3, undesirable_weight=0.8
    )
    assert off["loss"] != pytest.approx(theirs["eval_loss"], rel=1e-4)


def test_bad_rows_are_counted_drops_with_their_line_and_the_counts_are_said(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = unpaired_rows(6)
    bad = [
        {"prompt": good[0]["prompt"], "completion": good[0]["completion"]},  # no label
        {"prompt": good[0]["prompt"], "completion": good[0]["completion"], "label": None},
        {"prompt": good[0]["prompt"], "completion": good[0]["completion"], "label": "yes"},
        {"prompt": good[0]["prompt"], "completion": good[0]["completion"], "label": 1},
        {"prompt": good[0]["prompt"], "completion": [{"role": "assistant", "content": "  "}], "label": True},
    ]
    data = _jsonl(tmp_path / "kto.jsonl", good + bad)
    cfg = C.from_dict(
        {
            "output_dir": str(tmp_path / "out"),
            "model": {"name_or_path": str(tiny_llama)},
            "data": {"path": str(data), "seq_len": 256, "cache_dir": str(tmp_path / "cache")},
            "train": {"objective": "kto"},
        }
    )
    from trainer.training.inputs import prepare_data

    prepared = prepare_data(cfg)
    train = prepared.manifest["train"]
    assert train["dropped"] == {"empty_answer": 1, "label_not_bool": 2, "null_field": 2}
    lost = [json.loads(x) for x in (prepared.train_path.parent / "dropped.jsonl").read_text().splitlines()]
    assert [(e["line"], e["reason"]) for e in lost] == [
        (7, "null_field"),
        (8, "null_field"),
        (9, "label_not_bool"),
        (10, "label_not_bool"),
        (11, "empty_answer"),
    ]
    assert (train["desirable"], train["undesirable"]) == (4, 2)
    out, err = capsys.readouterr()
    assert "kto: 4 desirable and 2 undesirable answers" in out
    assert "outside KTO's recommended 1 to 4/3" in err and "train.desirable_weight within [0.5, 0.667]" in err

    from trainer.data.show import show_examples

    shown = show_examples(cfg.data, str(tiny_llama), 2, pairs=True)  # `spotune inspect --show`
    assert "kto.jsonl:1: desirable, " in shown and "kto.jsonl:2: undesirable, " in shown

    # The same data under another preference objective, and pairs under kto, are refused naming the fix.
    with pytest.raises(DataError, match="set train.objective=kto"):
        prepare_data(cfg.replace(**{"train.objective": "dpo"}))
    pairs = _jsonl(tmp_path / "pairs.jsonl", builtin_assets.make_pairs(4))
    with pytest.raises(DataError, match="train.objective=kto trains on unpaired feedback"):
        prepare_data(cfg.replace(**{"data.path": str(pairs)}))


def test_kto_guidance_on_the_weights() -> None:
    assert balance_note(10, 10, 1.0, 1.0) is None
    assert balance_note(12, 10, 1.0, 1.0) is None  # 1.2: within 1 to 4/3
    assert balance_note(40, 10, 1.0, 1.0) is not None
    assert balance_note(40, 10, 0.3, 1.0) is None  # TRL's fix: desirable_weight x 40 / 10 = 1.2
    assert "no undesirable answer" in (balance_note(5, 0, 1.0, 1.0) or "")


def test_kto_loss_by_hand() -> None:
    """The two branches at a known log-ratio and z0 (TRL's formulas), and z0 clamped at 0."""
    import math

    kto = Kto(beta=0.5, desirable_weight=2.0, undesirable_weight=0.5)
    logps = torch.tensor([-4.0, -9.0, -7.0, -10.0])  # answer, KL sequence, answer, KL sequence
    reference = torch.tensor([-5.0, -10.0, -6.0, -10.0])  # ratios 1 and -1; KL log-ratios 1 and 0: z0 = 0.5
    losses, rewards, z0 = kto.unit_terms(logps, reference, torch.tensor([True, False]))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert z0.item() == 0.5
    assert losses.tolist() == pytest.approx([2.0 * (1 - sig(0.5 * 0.5)), 0.5 * (1 - sig(0.5 * 1.5))])
    assert rewards.tolist() == [0.5, -0.5]
    below = kto.unit_terms(logps, reference + torch.tensor([0.0, 3.0, 0.0, 3.0]), torch.tensor([True, False]))
    assert below[2].item() == 0.0  # a negative estimate is clamped (KL is never below 0)


def test_config_and_other_tools_names(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"

    def load(text: str, *overrides: str) -> C.RunConfig:
        recipe.write_text(text)
        return C.load(recipe, list(overrides))

    def problems(text: str, *overrides: str) -> str:
        with pytest.raises(C.ConfigError) as e:
            load(text, *overrides)
        return str(e.value)

    # Axolotl's rl and its weights, LLaMA-Factory's stage and its, TRL's KTOConfig keys and its loss_type.
    for text in (
        "rl: kto\nkto_desirable_weight: 1.5\nkto_undesirable_weight: 0.5\n",
        "stage: kto\npref_beta: 0.1\nkto_chosen_weight: 1.5\nkto_rejected_weight: 0.5\n",
        "loss_type: kto\nbeta: 0.1\ndesirable_weight: 1.5\nundesirable_weight: 0.5\n",
    ):
        t = load(text).train
        assert (t.objective, t.beta, t.desirable_weight, t.undesirable_weight) == ("kto", 0.1, 1.5, 0.5), text
    assert load("rl: kto\n").train.desirable_weight == 1.0  # TRL's defaults
    assert "train.desirable_weight: only train.objective=kto reads it" in problems("rl: dpo\ndesirable_weight: 2\n")
    assert "set data.format to auto or prompt_completion" in problems("rl: kto\n", "data.format=preference")
    assert "kto has no SFT term" in problems("rl: kto\n", "train.sft_weight=1")
    assert "both are 0" in problems("rl: kto\n", "train.desirable_weight=0", "train.undesirable_weight=0")
    assert "reference is the run's starting point, fixed for the whole run" in problems(
        "rl: kto\nsync_ref_model: true\n"
    )
    assert "train_sampling_strategy" in problems("rl: kto\ntrain_sampling_strategy: sequential\n")
    assert C.structural_fields(load("rl: kto\n"))["train.objective"] == "kto"


def test_a_resumed_kto_run_equals_a_straight_one_bitwise(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 step, stop, 1 more = 2 straight (accumulation over packed rows, the reference in the same step);
    control: the checkpoints at steps 1 and 2 differ, so the comparison can fail."""
    from safetensors.torch import load_file

    import trainer.report

    monkeypatch.setattr(trainer.report, "report_after_train", lambda *a: None)  # the page is not what is tested

    data = _jsonl(tmp_path / "kto.jsonl", unpaired_rows(24))

    def make(name: str, steps: int) -> C.RunConfig:
        raw = {
            "output_dir": str(tmp_path / name),
            "seed": 3,
            "model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
            "adapter": {"r": 4, "alpha": 8},
            "data": {"path": str(data), "seq_len": 256, "cache_dir": str(tmp_path / "cache")},
            "train": {
                "objective": "kto",
                "max_steps": steps,
                "micro_batch_size": 1,
                "grad_accum": 2,
                "lr": 1e-2,
                "schedule": "constant",
            },
            "checkpoint": {"every_steps": None, "every_minutes": None},
            "metrics": {"progress": False, "report": False},
        }
        return C.from_dict(raw)

    assert run.train(make("straight", 2)) == 0
    assert run.train(make("split", 1)) == 0
    assert run.train(make("split", 2)) == 0  # the same output_dir: resumes from step 1

    def adapter(path: Path) -> dict[str, torch.Tensor]:
        return load_file(path / "adapter_model.safetensors")

    straight, split = adapter(tmp_path / "straight" / "final"), adapter(tmp_path / "split" / "final")
    assert straight.keys() == split.keys() and all(torch.equal(straight[k], split[k]) for k in straight)
    metrics = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if "loss" in m and "kl" in m]
    assert [m["step"] for m in logged] == [1, 2]  # resumed at 1 (from scratch, step 1 would be logged twice)
    assert logged[0]["loss"] == pytest.approx(0.5 * 1.0, abs=1e-6)  # step 1: policy == reference, z0 = 0
    assert all("rewards/chosen" in m and "desirable" in m for m in logged)
    step1 = adapter(tmp_path / "split" / "checkpoints" / "step-000001")
    assert any(not torch.equal(step1[k], split[k]) for k in split)  # control


def test_the_console_line_shows_kl_and_margin() -> None:
    from trainer.training.console import Console

    console = Console(10, bar=False, is_main=True)
    line = console.step_line(3, {"loss": 0.45, "kl": 0.125, "rewards/margins": 0.0123})
    assert line.startswith("spotune: step 3/10 loss 0.4500 | kl 0.125 margin 0.0123")
    assert "margin" not in console.step_line(3, {"loss": 0.45, "kl": 0.125})  # one label only in the step


def test_an_answer_and_its_kl_sequence_fit_one_row_or_the_row_drops(tiny_llama: Path) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer

    rows = unpaired_rows(6)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)

    def units(seq_len: int, overlong: str) -> Dataset:
        cfg = DataConfig(chat_template=TEMPLATE, seq_len=seq_len, overlong=overlong)  # type: ignore[arg-type]
        tok = tokenize_unpaired_for(cfg, tokenizer, "t").settle(list(rows[0]), rows)
        return with_kl(
            Dataset.from_dict(tok({c: [r[c] for r in rows] for c in rows[0]})), tok.lengths, seq_len, overlong
        )

    whole = units(1024, "drop")
    assert whole["status"] == [""] * 6
    sizes = sorted(len(ids) for ids in whole["input_ids"])
    seq_len = sizes[2]  # half the units fit as they are
    dropped = units(seq_len, "drop")
    assert dropped["status"].count("overlong") == sum(n > seq_len for n in sizes) > 0
    cut = units(seq_len, "truncate")
    for ids, labels, first, status in zip(
        cut["input_ids"], cut["labels"], cut["chosen_length"], cut["status"], strict=True
    ):
        assert status == "" and len(ids) <= seq_len
        assert any(x != -100 for x in labels[:first]) and any(x != -100 for x in labels[first:])  # both scored
    assert cut["length"] == whole["length"]  # the length before any cut, as pairs record it
