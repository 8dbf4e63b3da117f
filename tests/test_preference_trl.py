"""Equal to the peer: spotune's DPO on a held-out set gives TRL's `DPOTrainer` figures, for the same tiny
model, the same LoRA adapter (random, non-zero, so the policy differs from the reference), the same pairs
and beta: eval loss, rewards, reward accuracy and log-probabilities. spotune packs several pairs per row
(chosen and rejected as documents of one row); TRL pads each sequence to its own row. Both score the same
tokens (checked first), so the figures agree to float32 summation order.
With TRL's `max_length` and `truncation_mode` (given to spotune by those names) each answer's sequence is cut
as TRL's collator cuts it and the pairs whose prompt fills the cap are dropped as TRL drops them: the same tokens
and figures again.

Controls: the same evaluation of the pairs with chosen and rejected swapped differs in every figure (an
odd number of pairs, so the accuracy cannot come out at 1/2 both ways), and a beta off by 10% moves the
loss and the rewards. ORPO's and SimPO's losses are checked term for term against TRL's own functions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer import builtin_assets
from trainer.config import AdapterConfig, DataConfig, ModelConfig, TrainConfig
from trainer.data.prepare import prepare
from trainer.model.load import build
from trainer.model.preference import Preference
from trainer.training.loop import make_evaluator

# Asked of the installed packages, not imported at collection: the tests import TRL themselves.
pytestmark = pytest.mark.skipif(find_spec("trl") is None, reason="TRL is the peer compared against: the `bench` extra")

# The built-in template without the newline after an answer's EOS: TRL scores everything after the prompt,
# spotune an answer and its end of turn, so with nothing after the end of turn both score the same tokens.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}"
    "{{ eos_token }}{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PAIRS = 13  # odd: a swapped set cannot have the same reward accuracy
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def pairs() -> list[dict[str, Any]]:
    return builtin_assets.make_pairs(PAIRS, seed=11)


@pytest.fixture(scope="module")
def adapter(tiny_llama: Path) -> dict[str, torch.Tensor]:
    """Random LoRA weights (A and B), peft's saved keys: what both trainers evaluate."""
    from peft.utils import get_peft_model_state_dict

    model = build(ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(r=4, alpha=8, dropout=0.0))
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in get_peft_model_state_dict(model).items()}


def _spotune(
    tiny_llama: Path,
    adapter: dict[str, torch.Tensor],
    rows: list[dict[str, Any]],
    tmp: Path,
    data_cfg: DataConfig | None = None,
    kept: int | None = None,
    **train: Any,
) -> dict[str, float]:
    from accelerate import Accelerator
    from peft.utils import set_peft_model_state_dict

    from trainer.data.packed import PackedRows

    tmp.mkdir(parents=True, exist_ok=True)
    data = tmp / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = dataclasses.replace(data_cfg or DataConfig(seq_len=256), path=str(data), chat_template=TEMPLATE)
    prepared = prepare(cfg, str(tiny_llama), tmp / "cache", progress=False, pairs=True)
    assert prepared.manifest["train"]["pairs"] == (len(rows) if kept is None else kept)
    packed = PackedRows(prepared.train_path)
    assert (
        max(packed.take(slice(None))["num_pairs"]) > 1
    )  # several pairs share a row: the packed path is what is compared
    model = build(ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(r=4, alpha=8, dropout=0.0))
    set_peft_model_state_dict(model, adapter)
    out: dict[str, float] = {}

    def report(loss: float, seconds: float, extras: dict[str, float]) -> None:
        out.update(extras, loss=loss)

    objective = Preference.of(TrainConfig(objective="dpo", **train))
    evaluate = make_evaluator(packed, model, Accelerator(cpu=True), 4, report, objective)
    assert evaluate is not None
    evaluate()
    return out


def _trl(tiny_llama: Path, adapter: dict[str, torch.Tensor], rows: list[dict[str, Any]], tmp: Path, **args: Any):
    from datasets import Dataset
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = TEMPLATE
    ds = Dataset.from_list(rows)
    config = DPOConfig(
        output_dir=str(tmp / "trl"),
        per_device_eval_batch_size=len(rows),  # one batch: its mean is the mean over the pairs
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL's default is bf16 autocast; spotune's recipe here is float32
        save_strategy="no",
        logging_strategy="no",
        **{"max_length": None, **args},  # TRL's default caps at 1024; None unless a case sets it
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = DPOTrainer(
        base, args=config, train_dataset=ds, eval_dataset=ds, processing_class=tokenizer, peft_config=peft_config
    )
    set_peft_model_state_dict(trainer.model, adapter)  # the reference stays the base: adapters disabled
    return trainer, trainer.evaluate()


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_evaluation_equals_trl(
    tiny_llama: Path, adapter: dict[str, torch.Tensor], pairs: list[dict[str, Any]], tmp_path: Path, loss: str
) -> None:
    trainer, theirs = _trl(tiny_llama, adapter, pairs, tmp_path, beta=0.1, loss_type=[loss])
    # Both score the same tokens: TRL's prompt + answer ids are spotune's sequences, its answers the labelled part.
    from transformers import AutoTokenizer

    from trainer.data.pairs import tokenize_pairs_for

    tok = tokenize_pairs_for(
        DataConfig(chat_template=TEMPLATE, seq_len=512), AutoTokenizer.from_pretrained(tiny_llama), "t"
    )
    tok = tok.settle(list(pairs[0]), pairs)
    ours = tok({c: [r[c] for r in pairs] for c in pairs[0]})
    for i, ex in enumerate(trainer.eval_dataset):
        ids, labels, cut = ours["input_ids"][i], ours["labels"][i], ours["chosen_length"][i]
        assert ids == ex["prompt_ids"] + ex["chosen_ids"] + ex["prompt_ids"] + ex["rejected_ids"]
        assert [x for x in labels[:cut] if x != -100] == ex["chosen_ids"]
        assert [x for x in labels[cut:] if x != -100] == ex["rejected_ids"]

    mine = _spotune(tiny_llama, adapter, pairs, tmp_path / "spotune", beta=0.1, dpo_loss=loss)
    assert mine["loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5, abs=1e-6)
    assert 0.0 < mine["rewards/accuracies"] < 1.0  # a random adapter: some pairs each way, not a degenerate 0 or 1
    # The same pairs ranked right: a count (TRL reports its share in float32).
    assert round(mine["rewards/accuracies"] * PAIRS) == round(theirs["eval_rewards/accuracies"] * PAIRS)
    for name in FIGURES:
        assert abs(theirs[f"eval_{name}"]) > 1e-4, name  # non-trivial: the policy is not the reference
        assert mine[name] == pytest.approx(theirs[f"eval_{name}"], rel=1e-4, abs=1e-6), name

    # Controls: each figure can fail. Swapped pairs turn every figure around...
    swapped = [dict(r, chosen=r["rejected"], rejected=r["chosen"]) for r in pairs]
    flipped = _spotune(tiny_llama, adapter, swapped, tmp_path / "swapped", beta=0.1, dpo_loss=loss)
    assert flipped["loss"] != pytest.approx(theirs["eval_loss"], rel=1e-3)
    assert round(flipped["rewards/accuracies"] * PAIRS) != round(theirs["eval_rewards/accuracies"] * PAIRS)
    assert flipped["rewards/margins"] != pytest.approx(theirs["eval_rewards/margins"], rel=1e-2)
    # ...and a beta off by 10% moves the rewards (and the loss) beyond the tolerance.
    off = _spotune(tiny_llama, adapter, pairs, tmp_path / "beta", beta=0.11, dpo_loss=loss)
    assert off["loss"] != pytest.approx(theirs["eval_loss"], rel=1e-4)
    assert off["rewards/chosen"] != pytest.approx(theirs["eval_rewards/chosen"], rel=1e-3)


# (max_length, truncation_mode, pairs kept): every sequence longer than the cap is cut (4, 8 and 4 pairs); at 22
# the prompt alone fills the cap for 5 pairs, which keep_start drops in both.
@pytest.mark.parametrize(
    ("max_length", "mode", "kept"), [(40, "keep_start", 13), (22, "keep_start", 8), (30, "keep_end", 13)]
)
def test_dpo_truncation_equals_trl(
    tiny_llama: Path,
    adapter: dict[str, torch.Tensor],
    pairs: list[dict[str, Any]],
    tmp_path: Path,
    max_length: int,
    mode: str,
    kept: int,
) -> None:
    """TRL's `max_length` and `truncation_mode`, given to spotune by those names: each answer's sequence is cut
    as TRL's collator cuts it, the pairs whose prompt fills the cap are dropped as TRL drops them, and the eval
    figures agree. Control: the other truncation mode at the same cap moves the figures."""
    from transformers import AutoTokenizer

    from trainer.config import load
    from trainer.data.pairs import tokenize_pairs_for
    from trainer.data.template import NO_TRAINABLE_AFTER_TRUNCATION

    trainer, theirs = _trl(tiny_llama, adapter, pairs, tmp_path, beta=0.1, max_length=max_length, truncation_mode=mode)
    cfg = load(None, [f"max_length={max_length}", f"truncation_mode={mode}", "objective=dpo", "seq_len=256"]).data
    assert (cfg.max_length, cfg.truncation_mode) == (max_length, mode)

    # TRL's sequences as its collator cuts them (chosen ones first, then rejected), and the tokens it scores.
    examples = list(trainer.eval_dataset)
    assert len(examples) == kept
    batch = trainer.data_collator(examples)
    lengths = batch["attention_mask"].sum(1).tolist()
    seqs = [ids[:n] for ids, n in zip(batch["input_ids"].tolist(), lengths, strict=True)]
    scored = [[j for j in range(1, n) if m[j]] for m, n in zip(batch["completion_mask"].tolist(), lengths, strict=True)]
    full = [len(ex["prompt_ids"]) + len(ex[k]) for k in ("chosen_ids", "rejected_ids") for ex in examples]
    cut = sum(lengths[i] < full[i] or lengths[kept + i] < full[kept + i] for i in range(kept))
    assert cut >= 4 and max(lengths) == max_length  # several pairs are truncated, none beyond the cap

    # spotune's: the same ids per answer, its trained labels the tokens TRL scores, the same pairs dropped.
    tok = tokenize_pairs_for(
        dataclasses.replace(cfg, chat_template=TEMPLATE), AutoTokenizer.from_pretrained(tiny_llama), "t"
    )
    tok = tok.settle(list(pairs[0]), pairs)
    ours = tok({c: [r[c] for r in pairs] for c in pairs[0]})
    rows = [i for i, status in enumerate(ours["status"]) if not status]
    assert len(rows) == kept
    assert {ours["status"][i] for i in range(PAIRS) if i not in rows} <= {NO_TRAINABLE_AFTER_TRUNCATION}
    for k, i in enumerate(rows):
        ids, labels, n = ours["input_ids"][i], ours["labels"][i], ours["chosen_length"][i]
        assert (ids[:n], ids[n:]) == (seqs[k], seqs[kept + k])
        assert [j for j, x in enumerate(labels[:n]) if x != -100] == scored[k]
        assert [j for j, x in enumerate(labels[n:]) if x != -100] == scored[kept + k]

    mine = _spotune(tiny_llama, adapter, pairs, tmp_path / "spotune", cfg, kept, beta=0.1)
    assert mine["loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5, abs=1e-6)
    assert round(mine["rewards/accuracies"] * kept) == round(theirs["eval_rewards/accuracies"] * kept)
    for name in FIGURES:
        assert mine[name] == pytest.approx(theirs[f"eval_{name}"], rel=1e-4, abs=1e-6), name

    # Control: the other mode at the same cap keeps other tokens (and every pair), and the figures move.
    other = dataclasses.replace(cfg, truncation_mode="keep_end" if mode == "keep_start" else "keep_start")
    moved = _spotune(tiny_llama, adapter, pairs, tmp_path / "other", other, beta=0.1)
    assert moved["loss"] != pytest.approx(theirs["eval_loss"], rel=1e-4)  # 10x the tolerance above
    assert moved["logps/chosen"] != pytest.approx(theirs["eval_logps/chosen"], rel=1e-2)


def test_reference_free_losses_equal_trls_functions() -> None:
    """ORPO (trl.experimental.orpo) and SimPO (trl.experimental.cpo, loss_type=simpo) from the same
    per-token mean log-probs, through each trainer's own loss function; the control moves one input."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 40, (8,), generator=gen).float()
    logps = -torch.rand(8, generator=gen) * 3 * tokens  # summed per sequence, chosen/rejected interleaved
    chosen_avg, rejected_avg = logps[0::2] / tokens[0::2], logps[1::2] / tokens[1::2]
    peer = types.SimpleNamespace(accelerator=types.SimpleNamespace(device="cpu"), alpha=0.0)

    orpo = Preference("orpo", beta=0.25)
    losses, chosen_r, rejected_r, _ = orpo.pair_terms(logps, tokens, None)
    peer.beta = 0.25
    ratio_terms, trl_chosen, trl_rejected, _, _ = ORPOTrainer.odds_ratio_loss(peer, chosen_avg, rejected_avg)
    torch.testing.assert_close(losses, -ratio_terms)  # TRL subtracts beta * logsigmoid(log odds) from its NLL
    torch.testing.assert_close((chosen_r, rejected_r), (trl_chosen, trl_rejected))

    simpo = Preference("simpo", beta=2.0, label_smoothing=0.1, simpo_gamma=0.7)
    losses, chosen_r, rejected_r, _ = simpo.pair_terms(logps, tokens, None)
    peer.beta, peer.label_smoothing, peer.simpo_gamma, peer.loss_type = 2.0, 0.1, 0.7, "simpo"
    trl_losses, trl_chosen, trl_rejected = CPOTrainer.cpo_loss(peer, chosen_avg, rejected_avg)
    torch.testing.assert_close(losses, trl_losses)
    torch.testing.assert_close((chosen_r, rejected_r), (trl_chosen, trl_rejected))

    moved = logps.clone()
    moved[0] -= 1.0  # control: one chosen answer less likely
    assert not torch.allclose(simpo.pair_terms(moved, tokens, None)[0], trl_losses)
    assert not torch.allclose(orpo.pair_terms(moved, tokens, None)[0], -ratio_terms)


def test_dpo_losses_at_a_known_margin() -> None:
    """The four DPO losses at policy == reference and at a margin worked by hand (TRL's formulas)."""
    tokens = torch.tensor([4.0, 2.0])
    reference = torch.tensor([-10.0, -12.0])
    same = Preference("dpo", beta=0.1).pair_terms(reference.clone(), tokens, reference)
    assert same[0].item() == pytest.approx(math.log(2), abs=1e-7) and same[1].item() == same[2].item() == 0.0
    logps = torch.tensor([-8.0, -13.0])  # chosen up 2 nats, rejected down 1: delta 3
    expect = {
        "sigmoid": -math.log(1 / (1 + math.exp(-0.3))),
        "hinge": 1 - 0.3,
        "ipo": (2 / 4 - (-1) / 2 - 1 / 0.2) ** 2,
        "robust": (0.9 * math.log(1 + math.exp(-0.3)) - 0.1 * math.log(1 + math.exp(0.3))) / 0.8,
    }
    for loss, value in expect.items():
        got = Preference("dpo", beta=0.1, dpo_loss=loss, label_smoothing=0.1).pair_terms(logps, tokens, reference)
        assert got[0].item() == pytest.approx(value, rel=1e-6), loss
        assert (got[1].item(), got[2].item()) == pytest.approx((0.2, -0.1))
