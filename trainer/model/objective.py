"""What the loop minimises (`train.objective`): one interface, SFT's next-token loss and the preference
objectives (trainer/model/preference.py) behind it.

The reduction contract every objective keeps (trainer/training/loop.py relies on it): a micro-batch's
`loss` is a *sum* over the units of its `normaliser` (trainable tokens for SFT, pairs for preference
objectives), which the loop divides by the optimizer step's count of those units over every micro-batch
and rank. So a step's loss is the same for any micro-batch split and any rank count (up to summation
order). `stats` are sums over the same units, reduced with the loss and reported as means.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from trainer.config import TrainConfig
from trainer.model.loss import token_loss_sum


class Objective(Protocol):
    @property
    def stats(self) -> tuple[str, ...]:
        """Names of the per-micro-batch sums `loss` returns beside the loss (metrics rows report their means)."""
        ...

    def loss(
        self, model: torch.nn.Module, micro: dict[str, Any], counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum over the micro-batch's units, fp32 with its graph; stats sums, detached). `counts`:
        the step's (or evaluation's) `batches.COUNTS` over every rank, on the device."""
        ...

    def normaliser(self, counts: torch.Tensor) -> torch.Tensor:
        """The step's count of the loss's units, from its `counts`."""
        ...

    def report(self, stats: list[float], counts: list[float]) -> dict[str, float]:
        """The metrics-row figures from a step's reduced stats and counts."""
        ...


class Sft:
    """Next-token cross-entropy on the trained tokens, token-weighted over the step."""

    stats: tuple[str, ...] = ()

    def loss(
        self, model: torch.nn.Module, micro: dict[str, Any], counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return token_loss_sum(model, micro), torch.zeros(0, device=counts.device, dtype=torch.float64)

    def normaliser(self, counts: torch.Tensor) -> torch.Tensor:
        return counts[0]

    def report(self, stats: list[float], counts: list[float]) -> dict[str, float]:
        return {}


def objective_for(train: TrainConfig) -> Objective:
    """The objective `train.objective` names, with its settings."""
    if train.objective == "sft":
        return Sft()
    from trainer.model.preference import Preference

    return Preference.of(train)
