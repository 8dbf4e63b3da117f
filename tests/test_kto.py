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
from trainer.config import AdapterConfig, DataConfig, ModelConfig, TrainConfig
from trainer.data import prepare
from trainer.data.unpaired import tokenize_unpaired_for, with_kl
from trainer.model.load import build
from trainer.model.preference import Kto
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
    from datasets import load_from_disk
    from peft.utils import set_peft_model_state_dict

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
    packed = load_from_disk(str(prepared.train_path))
    assert max(packed["num_pairs"]) > 1  # several units share a row: the packed path is what is compared
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
