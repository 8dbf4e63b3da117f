"""The HF Trainer + PEFT side of benchmarks/gpu.py, with and without Liger Kernel, and Liger for spotune's lever."""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path
from typing import Any

import torch


def liger_skip_reason() -> str | None:
    """Why the HF + Liger arm cannot run here, or None when it can."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install 'spotune[gpu]')"
    if not torch.cuda.is_available():
        return "Liger Kernel's Triton kernels need CUDA"
    return None


def apply_liger(model: Any) -> None:
    """Liger's RMSNorm, SwiGLU and rotary on a transformers model (the instance HF's Trainer patches
    for `use_liger_kernel`); spotune's own head and loss stay, so no Liger loss is patched in."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, cross_entropy=False, fused_linear_cross_entropy=False)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_hf(
    path: Path, steps: list[list[Any]], args: argparse.Namespace, qlora: bool = False, liger: bool = False
) -> dict[str, Any]:
    """HF Trainer + PEFT as its docs show it: padding-free DataCollatorWithFlattening, sdpa;
    `liger`: `use_liger_kernel=True` (Liger's RMSNorm, SwiGLU, rotary and fused linear
    cross-entropy patched into the model by transformers)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import (
        AutoModelForCausalLM,
        BitsAndBytesConfig,
        DataCollatorWithFlattening,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    cuda = torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(dtype=torch.float32 if args.tiny else torch.bfloat16, attn_implementation="sdpa")
    if qlora:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        kwargs["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    gc_on = qlora or args.gradient_checkpointing
    if qlora:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    flatten = DataCollatorWithFlattening()
    items = [{"docs": row} for rows in steps for row in rows]

    def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
        return flatten([{"input_ids": i, "labels": y} for item in batch for i, y in item["docs"]])

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            sync()
            times.append(time.perf_counter() - self.start)

    rows_per_step = len(steps[0])
    targs = TrainingArguments(
        output_dir=str(args.work / "hf"),
        per_device_train_batch_size=args.mbs,
        gradient_accumulation_steps=rows_per_step // args.mbs,
        max_steps=len(steps),
        learning_rate=1e-5,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=gc_on,
        gradient_checkpointing_kwargs={"use_reentrant": False} if gc_on else None,
        logging_steps=10_000,
        save_strategy="no",
        report_to=[],
        remove_unused_columns=False,
        dataloader_drop_last=True,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        disable_tqdm=True,
        use_liger_kernel=liger,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=items, data_collator=collate, callbacks=[Clock()])
    trainer.train()
    del trainer, model
    return {"attn_implementation": "sdpa" + (" + liger" if liger else ""), "step_seconds": times}
