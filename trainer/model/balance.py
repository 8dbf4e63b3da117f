"""Router load balancing (`train.router_aux_loss_coef`): the mixture-of-experts auxiliary loss, added to any
objective's loss and reduced over the optimizer step like it.

transformers computes a family's load-balancing loss (Switch Transformer's, `load_balancing_loss_func` in the
model's own module) only when the forward is asked for `output_router_logits`, and adds it only to a loss it
computes from labels, which spotune's fused head never asks for. So the routers' logits are taken by forward
hooks while the objective's forward runs with gradients (never the DPO reference's, which runs under no_grad),
the family's own function turns them into the micro-batch's aux loss, and `Balanced` adds coef * aux * units,
where units are the micro-batch's units of the objective's loss (trainable tokens, or pairs): divided by the
step's units like the loss, the step minimises the units-weighted mean of its micro-batches' aux losses, the same
for any micro-batch split. Its mean is reported as `router_aux_loss`.

Families that balance without an auxiliary loss (DeepSeek-V3, GLM-4-MoE: a per-expert bias on sigmoid scores)
have no such function; for them, and for dense models, the objective is returned unchanged.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainer.model import experts
from trainer.model.objective import Counts, Objective
from trainer.model.wrappers import causal_lm

STAT = "router_aux_loss"


class Balanced:
    """`inner` plus `coef` times the routers' load-balancing loss (see the module docstring)."""

    def __init__(self, inner: Objective, coef: float, routers: list[torch.nn.Module], aux: Callable[..., Any]) -> None:
        self.inner, self.coef, self.routers, self.aux = inner, coef, routers, aux
        self.stats: tuple[str, ...] = (*inner.stats, STAT)

    def loss(
        self, model: torch.nn.Module, micro: dict[str, Any], counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with _captured(self.routers) as logits:
            loss, stats = self.inner.loss(model, micro, counts)
        units = micro["num_pairs"] if "num_pairs" in micro else micro["label_index"].numel()
        if not logits or not units:  # evaluation (no_grad), or a micro-batch without units
            return loss, torch.cat([stats, stats.new_zeros(1)])
        aux = self.aux(tuple(logits)).float() * units
        return loss + self.coef * aux, torch.cat([stats, aux.detach().double()[None]])

    def normaliser(self, counts: torch.Tensor) -> torch.Tensor:
        return self.inner.normaliser(counts)

    def report(self, stats: list[float], counts: Counts) -> dict[str, float]:
        units = float(self.inner.normaliser(counts.tensor()))
        return {**self.inner.report(stats[:-1], counts), STAT: stats[-1] / max(units, 1.0)}


@contextlib.contextmanager
def _captured(routers: list[torch.nn.Module]) -> Iterator[list[torch.Tensor]]:
    """The router logits ([tokens, experts] per layer) of the forwards run with gradients inside the block."""
    logits: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            logits.append(output[0] if isinstance(output, tuple) else output)

    hooks = [r.register_forward_hook(keep) for r in routers]
    try:
        yield logits
    finally:
        for hook in hooks:
            hook.remove()


def balanced(objective: Objective, model: torch.nn.Module, coef: float) -> tuple[Objective, str | None]:
    """`objective` with the router load-balancing term where `model` has routers and a load-balancing loss, and
    what the log should say (None for a dense model)."""
    lm = causal_lm(model)
    moe = experts.find(lm)
    if not moe.routers:
        return objective, None
    family = lm.config.model_type
    func = getattr(sys.modules.get(type(lm).__module__), "load_balancing_loss_func", None)
    if func is None:
        return objective, f"train.router_aux_loss_coef: {family} balances its routers without an auxiliary loss"
    if not coef:
        return objective, "train.router_aux_loss_coef=0: no router load-balancing loss"
    config = lm.config.get_text_config()
    n = next(getattr(config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts") if hasattr(config, k))
    top_k = config.num_experts_per_tok
    # The top-k routers only (a shared-expert gate is a router of another kind): those transformers' own
    # output_router_logits records.
    routers = [r for name, r in moe.routers.items() if not isinstance(r, torch.nn.Linear)]

    def aux(logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return func(logits, n, top_k, None)

    note = f"router load balancing: {family}'s auxiliary loss x {coef:g} (metric {STAT})"
    return Balanced(objective, coef, routers, aux), note
