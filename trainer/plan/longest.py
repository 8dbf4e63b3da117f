"""The longest row a GPU trains: one document that fills `data.seq_len` (micro-batch 1), with the
recipe's memory settings (`auto` counts as its most frugal choice: checkpointing, offloading and
MLP tiling on), found by bisection on the memory estimate. What someone with 100K-token legal or
code documents asks before renting a GPU: will one document fit, on which GPU, at what speed, and
how much host memory the offloaded activations take."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from trainer import catalog as cat
from trainer.model import flops
from trainer.plan import memory as mem
from trainer.plan.job import Job

UNIT = 1024
"""Rows are searched in multiples of this many tokens."""

CAP = 1 << 24
"""No row longer than this is tried (16M tokens)."""


def bisect_longest(fits: Callable[[int], bool], unit: int = UNIT, cap: int = CAP) -> int:
    """The largest multiple of `unit` (at most `cap`) for which `fits` holds, assuming it holds for
    every shorter one; 0 when not even `unit` fits."""
    if not fits(unit):
        return 0
    lo, hi = unit, unit * 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + unit)
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def longest_on(job: Job, budget_bytes: float, devices: int = 1, unit: int = UNIT) -> int:
    """The longest one-row `seq_len` of `job` whose estimate fits `budget_bytes` per device."""
    return bisect_longest(lambda n: one_row(job, n).memory(devices).total <= budget_bytes, unit)


def one_row(job: Job, seq_len: int) -> Job:
    """`job` training one row of `seq_len` tokens per micro-step."""
    return dataclasses.replace(job, seq_len=seq_len, train=dataclasses.replace(job.train, micro_batch_size=1))


def document_tokens_per_s(
    shape: flops.ModelShape, lora_params: int, seq_len: int, peak_flops: float, mfu: float
) -> float:
    """Tokens/s of one document of `seq_len` tokens at `mfu` of `peak_flops`: attention grows with
    the square of the document's length, so a long one is slower per token than packed short ones."""
    work = flops.train_flops(shape, seq_len, float(seq_len) ** 2, shape.matmul_params(), lora_params)
    return peak_flops * mfu * seq_len / work


def longest_rows(job: Job, gpus: list[cat.GPU], devices: int, assumed: float, unit: int = UNIT) -> dict[str, Any]:
    """Per GPU: the longest one-document row that fits (on `devices` of it, sharded under FSDP), the
    GPU and host memory at that length and its tokens/s at the `assumed` MFU."""
    # With the MLP untiled, say what `model.tiled_mlp=auto` would reach: usually twice as long.
    tiled = dataclasses.replace(job, model=dataclasses.replace(job.model, tiled_mlp="auto"))
    rows = []
    for g in gpus:
        budget = g.memory_gib * mem.GIB
        seq = longest_on(job, budget, devices, unit)
        at = one_row(job, seq).memory(devices) if seq else None
        rows.append(
            {
                "gpu": g.name,
                "memory_gib": g.memory_gib,
                "longest_seq_len": seq,
                "gpu_gib": at.total / mem.GIB if at else None,
                "host_gib": at.offloaded / mem.GIB if at else None,
                "tokens_per_s": (
                    document_tokens_per_s(job.shape, job.lora_params, seq, g.peak_bf16_flops, assumed) if seq else None
                ),
                "longest_seq_len_tiled": (
                    longest_on(tiled, budget, devices, unit) if job.model.tiled_mlp == "off" else None
                ),
            }
        )
    m = job.model
    settings = {
        "gradient_checkpointing": m.gradient_checkpointing,
        "activation_offload": m.activation_offload,
        "tiled_mlp": m.tiled_mlp,
    }
    return {
        "model": job.name_or_path,
        "method": job.adapter.method,
        "r": job.adapter.r,
        "devices": devices,
        "settings": settings,
        "assumed_mfu": assumed,
        "rows": rows,
    }


def format_longest(result: dict[str, Any]) -> str:
    """The table `spotune estimate --longest` prints."""
    s = result["settings"]
    untiled = s["tiled_mlp"] == "off"
    shown = ", ".join(f"{k}={v}" for k, v in s.items())
    lines = [
        f"longest one-document row of {result['model']} ({result['method']} r{result['r']}, micro-batch 1, "
        f"{result['devices']} GPU(s)); {shown} (`auto` counts as on)",
        f"{'GPU':24} {'memory':>8} {'longest row':>12} {'GPU GiB':>8} {'host GiB':>9} {'tokens/s':>9}"
        + (f" {'tiled_mlp=auto':>15}" if untiled else ""),
    ]
    for r in result["rows"]:
        more = f" {r['longest_seq_len_tiled']:15,d}" if untiled else ""
        if not r["longest_seq_len"]:
            lines.append(f"{r['gpu']:24} {r['memory_gib']:8.1f} {'none fits':>12} {'':8} {'':9} {'':9}{more}")
            continue
        lines.append(
            f"{r['gpu']:24} {r['memory_gib']:8.1f} {r['longest_seq_len']:12,d} {r['gpu_gib']:8.1f} "
            f"{r['host_gib']:9.1f} {r['tokens_per_s']:9.0f}{more}"
        )
    lines.append(
        f"tokens/s: one document filling the row at an assumed MFU of {result['assumed_mfu']:g} (+/-30%; "
        "`spotune pilot` measures it); host GiB: the offloaded activations, in pinned host memory"
    )
    return "\n".join(lines)
