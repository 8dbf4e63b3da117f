"""The estimate of a run whose data is not at hand: the memory fit per GPU, which needs only the
model's shape and the recipe, what a million trained tokens cost there, and what the rest (time and
cost of the run) needs.

`spotune estimate RECIPE` on a machine without the recipe's data file still answers whether the
run fits each catalogue GPU (and on how many under FSDP where one is too small), and which fitting GPU
trains a token for the least money: a GPU's price per hour alone would rank a slow cheap GPU above a
fast one that finishes the same data for less. The hours and the money of the run need the data's
token count: `data.path=FILE`, or `--tokens N` (workload.from_tokens).
"""

from __future__ import annotations

from typing import Any

from trainer import catalog as cat
from trainer.plan import PlanError, changes
from trainer.plan import memory as mem
from trainer.plan.estimate import MULTI_GPU_EFFICIENCY, SCHEMA, flops_per_token, memory_settings, model_facts
from trainer.plan.job import Constraints, Job
from trainer.plan.throughput import Throughput, rate_on

NO_DATA = "none given (data.path is unset; its default, the built-in demo set, is not the data this run would train on)"
"""The data problem of `spotune estimate MODEL` without data.path: what it does not price."""
NEEDS = (
    "time and cost need the data's size: give data.path=FILE (the data the run trains on), or --tokens N "
    "(its tokens per epoch)"
)


def memory_fit(
    job: Job,
    catalog: list[cat.GPU],
    constraints: Constraints,
    problem: str,
    rate: Throughput,
    how: changes.How | None = None,
) -> dict[str, Any]:
    """The estimate document (schema `spotune.estimate/1`) with the memory fit only: `data.source` is
    `none`, `options` hold one row per GPU with its prices and its cost per million trained tokens
    (`per_million_tokens`, at `rate`) but without hours, `needs` says what the rest needs; `cheapest` the GPU
    that fits at the lowest cost per million tokens, on demand and spot."""
    try:
        gpus = [cat.find_gpu(constraints.gpu, catalog)] if constraints.gpu is not None else catalog
    except cat.CatalogError as e:
        raise PlanError(str(e)) from None
    memory = job.memory(constraints.gpus)
    per_token = flops_per_token(job, constraints.gpus)
    n = constraints.gpus
    options = []
    for g in gpus:
        fits = memory.total <= g.memory_gib * mem.GIB
        on = rate_on(rate, g, catalog, per_token)
        speed = on.tokens_per_s_per_gpu * n * (MULTI_GPU_EFFICIENCY if n > rate.measured_gpus else 1.0)
        options.append(
            {
                "gpu": g.name,
                "gpus": constraints.gpus,
                "memory_gib": g.memory_gib,
                "fits": fits,
                "fsdp_gpus": None if fits else job.fsdp_devices(g.memory_gib),
                "on_demand_price": g.on_demand_price,
                "spot_price": g.spot_price,
                "mtbi_hours": g.mtbi_hours,
                "tokens_per_s": speed,
                "throughput_basis": on.basis,
                "per_million_tokens": {
                    pricing: None if price is None else price * n / (speed * 3600) * 1e6
                    for pricing, price in (("on-demand", g.on_demand_price), ("spot", g.spot_price))
                },
            }
        )
    changes.annotate(options, job, constraints.gpus, how)
    return {
        "schema": SCHEMA,
        "model": model_facts(job),
        "data": {"source": "none", "exact": False, "problem": problem},
        "run": {"gpus": constraints.gpus, "seq_len": job.seq_len, "global_batch_rows": job.train.global_batch_size},
        "memory_gib": memory.as_gib()
        | {"sharded_over": constraints.gpus if job.fsdp else 1, "settings": memory_settings(job)},
        "options": options,
        "recommendation": None,
        "throughput": rate.as_dict() | {"flops_per_token": per_token},
        "cheapest": {
            pricing: _cheapest_per_token(options, pricing, key)
            for pricing, key in (("on-demand", "on_demand_price"), ("spot", "spot_price"))
        },
        "needs": NEEDS,
    }


def _cheapest_per_token(rows: list[dict[str, Any]], pricing: str, key: str) -> dict[str, Any] | None:
    """The fitting GPU that trains a million tokens for the least money (the run's size, unknown here, scales
    every GPU's cost alike; spot before interruptions, whose cost needs the run's length)."""
    fitting = [r for r in rows if r["fits"] and r["per_million_tokens"][pricing] is not None]
    best = min(fitting, key=lambda r: r["per_million_tokens"][pricing], default=None)
    if best is None:
        return None
    return {
        "gpu": best["gpu"],
        "gpus": best["gpus"],
        "price_per_gpu_hour": best[key],
        "per_million_tokens": best["per_million_tokens"][pricing],
        "setting": (best.get("setting") or {}).get("setting"),
    }
