"""What the loop minimises (`train.objective`): one interface, SFT's next-token loss and the preference
objectives (trainer/model/preference.py) behind it.

The reduction contract every objective keeps (trainer/training/loop.py relies on it): a micro-batch's
`loss` is a *sum* over the units of its `normaliser` (trainable tokens for SFT, pairs for preference
objectives), which the loop divides by the optimizer step's count of those units over every micro-batch
and rank. So a step's loss is the same for any micro-batch split and any rank count (up to summation
order). `stats` are sums over the same units, reduced with the loss and reported as means.

`Counts` is the one layout of what a step counts (trainer/training/batches.py fills it per micro-batch, the
loop reduces it over ranks as one int64 tensor and reads it back after the step, the objectives take their
units from it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import torch

from trainer.model.loss import token_loss_sum


class Counts(NamedTuple):
    """What an optimizer step (or an evaluation) counts over its micro-batches and ranks. It travels as an
    int64 tensor in this order (`tensor`: one all-reduce for every field); the objectives index that tensor
    on the device with the constants below, the loop reads it back on the host as a `Counts`."""

    trainable: int = 0
    """Tokens that carry a label (after the shift): SFT's units, and where the head's logits are computed."""
    real: int = 0
    """Non-padding tokens."""
    doc_len_sq: int = 0
    """Sum over documents of length squared (causal attention's FLOPs)."""
    pairs: int = 0
    """Preference pairs (0 for SFT rows): a preference objective's units."""
    chosen_tokens: int = 0
    """The pairs' chosen sequences' trainable tokens (what the SFT term of a preference objective averages over)."""

    def tensor(self) -> torch.Tensor:
        return torch.tensor(self, dtype=torch.int64)

    @classmethod
    def total(cls, parts: Iterable[Counts]) -> Counts:
        """The field-wise sum of `parts` (a tuple's `+` would concatenate)."""
        return cls(*(sum(column) for column in zip(cls(), *parts, strict=True)))


TRAINABLE, PAIRS, CHOSEN_TOKENS = (Counts._fields.index(name) for name in ("trainable", "pairs", "chosen_tokens"))
"""Where the objectives find their units in the counts tensor."""


class Objective(Protocol):
    @property
    def stats(self) -> tuple[str, ...]:
        """Names of the per-micro-batch sums `loss` returns beside the loss (metrics rows report their means)."""
        ...

    def loss(
        self, model: torch.nn.Module, micro: dict[str, Any], counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum over the micro-batch's units, fp32 with its graph; stats sums, detached). `counts`:
        the step's (or evaluation's) `Counts` over every rank, as the tensor on the device."""
        ...

    def normaliser(self, counts: torch.Tensor) -> torch.Tensor:
        """The step's count of the loss's units, from its `counts` tensor."""
        ...

    def report(self, stats: list[float], counts: Counts) -> dict[str, float]:
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
        return counts[TRAINABLE]

    def report(self, stats: list[float], counts: Counts) -> dict[str, float]:
        return {}
