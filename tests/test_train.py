"""The training path end to end on tiny random models (CPU): loss falls, final/ loads with
plain peft and reproduces the trained model's logits, export --merge matches base+adapter,
QLoRA 4-bit runs, the loss is token-weighted over the whole step, and a non-finite step
never touches the weights."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from accelerate import Accelerator

from trainer import config as C
from trainer.config import AdapterConfig, ModelConfig
from trainer.data.chat_templates import NAMED
from trainer.data.packed import PackedRows
from trainer.data.sampler import StepSampler
from trainer.model import loss as micro_loss
from trainer.model.load import build
from trainer.restart.local.state import Counters
from trainer.serve.export import export
from trainer.training import batches as step_data
from trainer.training import loop, run


def make_cfg(out: Path, **dotted: Any) -> C.RunConfig:
    base: dict[str, Any] = {
        "output_dir": str(out),
        "model.dtype": "float32",
        "data.seq_len": 256,
        "train.micro_batch_size": 2,
        "metrics.progress": False,
        "metrics.report": False,
        "checkpoint.every_minutes": None,
    }
    base.update(dotted)
    return C.RunConfig().replace(**base)


def metrics_rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def sample_ids(seed: int = 0, rows: int = 2, length: int = 48, vocab: int = 500) -> torch.Tensor:
    return torch.randint(4, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


# ---------------------------------------------------------------------------- end to end


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped tiny recipe (builtin model and data), shortened, rendered with the named alpaca chat
    template instead of the tiny tokenizer's own (final/ and exports must carry it); shared below."""
    out = tmp_path_factory.mktemp("run")
    cfg = C.load(
        REPO / "recipes" / "tiny-cpu.yaml",
        [
            f"output_dir={out}",
            "train.max_steps=24",
            "train.micro_batch_size=2",
            "train.grad_accum=1",
            "train.warmup_steps=2",
            "checkpoint.every_steps=12",
            "checkpoint.every_minutes=null",
            "metrics.log_every=1",
            "metrics.progress=false",
            "metrics.report=false",
            "data.eval_fraction=0.02",
            "train.eval_every=12",
            "data.chat_template=alpaca",
        ],
    )
    assert run.train(cfg) == 0
    return out


def test_tiny_recipe_trains_and_loss_falls(trained_run: Path) -> None:
    all_rows = metrics_rows(trained_run)
    evals = [r for r in all_rows if "eval_loss" in r]
    rows = [r for r in all_rows if "loss" in r]
    assert [r["step"] for r in evals] == [12, 24]
    assert evals[-1]["eval_loss"] < rows[0]["loss"] - 0.3, "held-out loss improves on the random start"
    assert [r["step"] for r in rows] == list(range(1, 25))
    losses = [r["loss"] for r in rows]
    assert all(math.isfinite(x) for x in losses)
    first, last = losses[0], sum(losses[-6:]) / 6
    assert first > math.log(500), f"random init should start near ln(vocab), got {first}"
    assert last < first - 0.4, f"loss did not fall clearly: first {first:.3f}, mean of last six {last:.3f}"
    row = rows[-1]
    for key in (
        "lr",
        "grad_norm",
        "trainable_tokens",
        "real_tokens",
        "tokens_per_s",
        "sustained_tokens_per_s",
        "step_time_s",
        "data_stall_share",
        "mfu",
        "peak_memory_gib",
        "device_hours",
        "cost",
    ):
        assert key in row, key
    assert row["mfu"] is None  # CPU without metrics.peak_flops
    assert 0 < row["trainable_tokens"] < row["real_tokens"] <= 24 * 2 * 256
    assert row["peak_memory_gib"] > 0 and row["device_hours"] > 0
    steps = sorted(p.name for p in (trained_run / "checkpoints").iterdir())
    assert steps == ["step-000012", "step-000024"]
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= {
        p.name for p in (trained_run / "final").iterdir()
    }


def test_final_adapter_loads_with_plain_peft_and_matches(trained_run: Path) -> None:
    from peft import PeftModel
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter_cfg = json.loads((trained_run / "final" / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(adapter_cfg["base_model_name_or_path"], dtype=torch.float32)
    ids = sample_ids()
    base_logits = logits_of(base, ids)
    loaded = PeftModel.from_pretrained(base, str(trained_run / "final"))
    # The trained model as spotune builds it, holding the weights of its last step (the
    # step-24 checkpoint, written from the live model by the same code path as a resume reads).
    cfg = C.load(trained_run / "config.yaml")
    ours = build(cfg.model, cfg.adapter, name_or_path=adapter_cfg["base_model_name_or_path"])
    set_peft_model_state_dict(
        ours, load_file(trained_run / "checkpoints" / "step-000024" / "adapter_model.safetensors")
    )
    expected = logits_of(ours, ids)
    got = logits_of(loaded, ids)
    assert torch.equal(got, expected)
    assert not torch.allclose(got, base_logits, atol=1e-4), "control: the adapter must change the logits"


def test_export_merge_matches_base_plus_adapter(trained_run: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged_dir = export(trained_run, tmp_path / "merged", merge=True)
    copied = export(trained_run, tmp_path / "adapter", merge=False)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in copied.iterdir()}
    base_path = json.loads((trained_run / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]
    ids = sample_ids(1)
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_path), str(trained_run / "final")
    )
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    # Merging folds B@A into W, which reorders fp32 sums: equal up to rounding, not bitwise.
    torch.testing.assert_close(logits_of(merged, ids), logits_of(with_adapter, ids), rtol=1e-4, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(base_path)
    assert not torch.allclose(logits_of(base, ids), logits_of(merged, ids), atol=1e-4), "control: merge changed nothing"
    # what the run trained with is what a server loading final/, the export or the merge applies
    for served in (trained_run / "final", copied, merged_dir):
        assert AutoTokenizer.from_pretrained(served).chat_template == NAMED["alpaca"], served
    assert AutoTokenizer.from_pretrained(base_path).chat_template != NAMED["alpaca"]  # control: the base's differs


def test_an_exported_checkpoint_serves_as_final_would(trained_run: Path, tmp_path: Path) -> None:
    """A run that never reached final/ (preempted, budget-stopped) exports its newest checkpoint, which
    carries no tokenizer and no generation config: the export writes the ones final/ would have held."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    unfinished = tmp_path / "unfinished"
    shutil.copytree(trained_run, unfinished, ignore=lambda d, names: ["final"] if Path(d) == trained_run else [])
    assert not any(p.name.startswith("tokenizer") for p in (unfinished / "checkpoints" / "step-000024").iterdir())
    out = export(unfinished, tmp_path / "export")
    final = trained_run / "final"
    assert AutoTokenizer.from_pretrained(out).chat_template == NAMED["alpaca"]  # the run's template, not the base's
    assert GenerationConfig.from_pretrained(out).to_dict() == GenerationConfig.from_pretrained(final).to_dict()
    served = {p.name for p in final.iterdir()} - {"README.md"}  # PEFT's model card is no part of serving
    assert {p.name for p in out.iterdir()} == served
    # from final/ every tokenizer file is copied (the one list of them), byte for byte
    copied = export(trained_run, tmp_path / "from-final")
    assert {p.name for p in copied.iterdir()} == served
    for name in served:
        assert (copied / name).read_bytes() == (final / name).read_bytes(), name


def test_qlora_4bit_with_8bit_adamw_trains_on_cpu(tmp_path: Path, tiny_llama: Path, tiny_data: Path) -> None:
    cfg = make_cfg(
        tmp_path / "q",
        **{
            "model.name_or_path": str(tiny_llama),
            "model.dtype": "bfloat16",
            "adapter.method": "qlora",
            "data.path": str(tiny_data),
            "data.seq_len": 128,
            "train.max_steps": 3,
            "train.lr": 1e-2,
            "train.optimizer": "adamw_8bit",  # bitsandbytes' optimizer state must also checkpoint
        },
    )
    assert run.train(cfg) == 0
    losses = [r["loss"] for r in metrics_rows(tmp_path / "q")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert (tmp_path / "q" / "final" / "adapter_model.safetensors").is_file()


def test_budget_guard_stops_with_a_checkpoint(tmp_path: Path, tiny_llama: Path, tiny_data: Path) -> None:
    from trainer import exit_codes

    out = tmp_path / "b"
    cfg = make_cfg(
        out,
        **{
            "model.name_or_path": str(tiny_llama),
            "data.path": str(tiny_data),
            "data.seq_len": 128,
            "train.max_steps": 50,
            "train.max_gpu_hours": 1e-9,
            "metrics.trackers": ["tensorboard"],
        },
    )
    assert run.train(cfg) == exit_codes.EXIT_BUDGET
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000001"]
    assert len(metrics_rows(out)) == 1 and (out / "final" / "adapter_model.safetensors").is_file()
    assert list(out.rglob("events.out.tfevents.*")), "the optional TensorBoard tracker wrote its event file"


# ---------------------------------------------------------------------------- loop maths


def test_head_only_where_labels_are_gives_the_plain_loss(tiny_llama: Path) -> None:
    rows = _rows(lengths=[64, 20, 50], trainable=[60, 0, 30])  # the middle row has no label at all
    cols = rows.take(slice(None))
    micro = step_data.micro_batch(*(torch.from_numpy(step_data.stack_column(cols[k])) for k in step_data.COLUMNS))
    assert micro["label_index"].shape == (90,) and int(micro["label_index"].max()) == 2 * 64 + 48
    model = _model(tiny_llama)
    with torch.no_grad():  # reference: every logit, shifted, from the model's own head
        logits = model(input_ids=micro["input_ids"], position_ids=micro["position_ids"], use_cache=False).logits
        expected = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)), micro["labels"][:, 1:].reshape(-1), reduction="sum"
        )
        got = micro_loss.token_loss_sum(model, micro)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
        shuffled = {**micro, "label_targets": micro["label_targets"].roll(1)}
        assert abs(micro_loss.token_loss_sum(model, shuffled) - expected) > 1e-3, (
            "control: misaligned labels change the loss"
        )


def _same(a: object, b: object) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b


def _rows(lengths: list[int], trainable: list[int], seq_len: int = 64, seed: int = 0) -> PackedRows:
    """Packed-format rows of one document each; the last `trainable` tokens of a document carry labels."""
    g = torch.Generator().manual_seed(seed)
    cols: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "num_real": []}
    for n, k in zip(lengths, trainable, strict=False):
        ids = torch.randint(4, 500, (seq_len,), generator=g)
        ids[n:] = 3  # pad
        labels = torch.full((seq_len,), -100)
        labels[n - k : n] = ids[n - k : n]
        cols["input_ids"].append(ids.tolist())
        cols["labels"].append(labels.tolist())
        cols["position_ids"].append(list(range(seq_len)))
        cols["num_real"].append(n)
    return PackedRows.of(cols)


def _model(tiny_llama: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build(ModelConfig(name_or_path=str(tiny_llama), dtype="float32"), AdapterConfig(r=4, dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; make A's gradient non-zero too
            torch.nn.init.normal_(p, std=0.02)
    return model


def _lora_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _one_step(tiny_llama: Path, rows: PackedRows, mbs: int, ga: int) -> dict[str, torch.Tensor]:
    """Weight change of one SGD(lr=1) step through `train_loop`, i.e. minus the applied gradient."""
    accelerator = Accelerator(cpu=True)
    model = _model(tiny_llama)
    before = _lora_state(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    model, opt = accelerator.prepare(model, opt)
    sampler = StepSampler(len(rows), mbs * ga, seed=0, shuffle=False)
    batches = step_data.StepDataset(rows, sampler, 0, 1, mbs, total_steps=1)
    plan = loop.LoopPlan(total_steps=1, lr=loop.LrSchedule(peak=1.0, total_steps=1, kind="constant"), max_grad_norm=0.0)
    reason = loop.train_loop(accelerator, model, opt, [batches[0]], plan, Counters(), loop.Hooks(save=lambda p: 0.0))
    assert reason == "finished"
    return {n: before[n] - p for n, p in _lora_state(model).items()}


def test_accumulation_is_token_weighted(tiny_llama: Path) -> None:
    rows = _rows(lengths=[64, 20, 50, 12], trainable=[60, 3, 30, 8])
    batched = _one_step(tiny_llama, rows, mbs=4, ga=1)
    accumulated = _one_step(tiny_llama, rows, mbs=1, ga=4)
    for name in batched:
        # atol: one micro-batch of 4 rows and 4 of 1 sum in another order (fused CE chunks, matmul shapes).
        torch.testing.assert_close(accumulated[name], batched[name], rtol=1e-5, atol=1e-7)

    # Independent reference: d(total loss / total trainable tokens) over the four rows at once.
    model = _model(tiny_llama)
    cols = rows.take(slice(None))
    full = [torch.from_numpy(step_data.stack_column(cols[k])) for k in step_data.COLUMNS]
    micro = step_data.micro_batch(*full)
    (micro_loss.token_loss_sum(model, micro) / step_data.count_trainable(micro["labels"])).backward()
    reference = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    for name in batched:
        torch.testing.assert_close(batched[name], reference[name], rtol=1e-5, atol=1e-8)

    # Control: the naive mean of per-micro-batch means weights a 3-token row like a 60-token one.
    model = _model(tiny_llama)
    for i in range(4):
        one = step_data.micro_batch(*(column[i : i + 1] for column in full))
        (micro_loss.token_loss_sum(model, one) / step_data.count_trainable(one["labels"]) / 4).backward()
    naive = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    worst = max(((naive[n] - reference[n]).abs().max() / reference[n].abs().max()).item() for n in reference)
    assert worst > 0.05, f"control failed: naive averaging should differ on variable-length data (got {worst})"


def test_non_finite_step_is_skipped_and_weights_untouched(tiny_llama: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model = _model(tiny_llama)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    rows = _rows(lengths=[64, 40, 50, 30, 64, 20], trainable=[30, 20, 25, 10, 30, 10])
    sampler = StepSampler(len(rows), 1, seed=0, shuffle=False)
    poison = {2, 4, 5}  # optimizer steps whose loss becomes NaN

    def nan_hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output * float("nan") if current["step"] in poison else output

    current = {"step": 0}
    # The embeddings, not the output head: trainer.model.loss applies the head weight itself.
    embed = accelerator.unwrap_model(model).get_input_embeddings()
    embed.register_forward_hook(nan_hook)
    snapshots: dict[int, dict[str, torch.Tensor]] = {0: _lora_state(model)}
    adam_steps: dict[int, float] = {}

    def on_log(row: dict[str, Any]) -> None:
        snapshots[row["step"]] = _lora_state(model)
        adam_steps[row["step"]] = float(next(iter(opt.state.values()))["step"])
        current["step"] = row["step"]

    dataset = step_data.StepDataset(rows, sampler, 0, 1, 1, total_steps=6)
    plan = loop.LoopPlan(total_steps=6, lr=loop.LrSchedule(peak=1e-2, total_steps=6, kind="constant"), max_bad_steps=2)
    progress = Counters()
    messages: list[str] = []
    reason = loop.train_loop(
        accelerator,
        model,
        opt,
        [dataset[i] for i in range(6)],
        plan,
        progress,
        loop.Hooks(save=lambda p: 0.0, on_step=lambda r: on_log({"step": r.counters.step}), message=messages.append),
    )

    assert not all(torch.equal(snapshots[1][n], snapshots[0][n]) for n in snapshots[0]), "control: a good step trains"
    assert all(torch.equal(snapshots[3][n], snapshots[2][n]) for n in snapshots[2]), "the NaN step changed weights"
    assert adam_steps[3] == adam_steps[2] == 2.0
    assert not all(torch.equal(snapshots[4][n], snapshots[3][n]) for n in snapshots[3]), "training resumed after it"
    # Steps 4 and 5 are bad in a row: max_bad_steps=2 stops the run there, weights as after step 4.
    assert reason == "bad_steps" and progress.step == 6 and progress.skipped_steps == 3
    assert all(torch.equal(snapshots[6][n], snapshots[4][n]) for n in snapshots[4])
    assert any("non-finite" in m for m in messages) and "train.max_bad_steps" in messages[-1]


# ---------------------------------------------------------------------------- schedule


def test_document_lengths_for_the_flop_count() -> None:
    assert step_data.document_lengths(np.array([0, 1, 2, 0, 1, 0])).tolist() == [3, 2, 1]
    assert step_data.document_lengths(np.array([0, 1, 2, 3])).tolist() == [4]


def test_prefetching_worker_yields_the_same_batches_from_any_step() -> None:
    rows = _rows(lengths=[64, 40, 50, 30, 64, 20, 33, 41], trainable=[30, 20, 25, 10, 30, 10, 5, 7])
    dataset = step_data.StepDataset(rows, StepSampler(len(rows), 2, seed=3), 0, 1, 2, total_steps=8)
    inline = list(step_data.step_loader(dataset, 0, torch.device("cpu"), seed=0, workers=0))
    prefetched = list(step_data.step_loader(dataset, 5, torch.device("cpu"), seed=0, workers=1))  # a resume at step 5
    assert [b.step for b in inline] == list(range(8)) and [b.step for b in prefetched] == [5, 6, 7]
    for a, b in zip(inline[5:], prefetched, strict=False):
        assert torch.equal(a.counts, b.counts)
        assert all(_same(a.micro[0][k], b.micro[0][k]) for k in a.micro[0])
    assert not torch.equal(inline[0].micro[0]["input_ids"], inline[1].micro[0]["input_ids"]), "control"


def test_lr_schedule_values() -> None:
    cos = loop.LrSchedule(peak=1.0, total_steps=12, warmup_steps=2, kind="cosine", min_lr_ratio=0.1)
    assert [cos(0), cos(1)] == [0.5, 1.0]  # warm-up reaches the peak on its last step
    assert cos(2) == 1.0
    assert cos(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos(12) == pytest.approx(0.1) and cos(50) == pytest.approx(0.1)
    lin = loop.LrSchedule(peak=2.0, total_steps=10, kind="linear")
    assert [lin(0), lin(5)] == [2.0, 1.0] and lin(9) == pytest.approx(0.2)
    const = loop.LrSchedule(peak=3.0, total_steps=10, warmup_steps=3, kind="constant")
    assert [const(0), const(2), const(9)] == [1.0, 3.0, 3.0]
    values = [cos(s) for s in range(2, 12)]
    assert values == sorted(values, reverse=True), "cosine decays monotonically after warm-up"


def test_progress_bar_shows_throughput_and_projected_cost(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = make_cfg(
        tmp_path / "bar",
        **{
            "model.name_or_path": str(tiny_llama),
            "data.path": str(tiny_data),
            "train.max_steps": 4,
            "metrics.progress": True,
            "metrics.log_every": 2,
            "metrics.price_per_hour": 2.0,
            "metrics.warmup_steps": 1,
        },
    )
    assert run.train(cfg) == 0
    err = capsys.readouterr().err  # not a terminal: the bar's figures come as lines (tests/test_console.py)
    line = r"^spotune: step 4/4 loss \d+\.\d{4} \| [\d,]+ tok/s, [\d.]+ step/s \| .* \| \$\d+\.\d\d so far, \$\d+\.\d\d projected$"
    assert re.search(line, err, re.M), err
    rows = [r for r in metrics_rows(tmp_path / "bar") if "loss" in r]
    assert rows[-1]["projected_cost"] == pytest.approx(rows[-1]["cost"], rel=1e-3)  # last step: nothing left
