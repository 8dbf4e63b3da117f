"""Preference objectives on packed pairs: DPO (sigmoid, IPO, hinge, robust), ORPO and SimPO, as TRL
defines each (trl/trainer/dpo_trainer.py `_compute_loss`; trl/experimental/orpo, cpo), KTO on unpaired
answers (trl/trainer/kto_trainer.py, `Kto`), and the per-token log-probabilities they are built from.

A micro-batch holds whole pairs (trainer/training/batches.py): each sequence's labelled tokens lie
contiguously in `label_index` order, chosen before rejected, `seq_lengths` long (`seq_tokens` on the device). Per sequence, log p =
the sum of its tokens' log-probabilities, each summed alone (so a pair's figure does not depend on what
else the micro-batch holds). `dpo` computes the same for the reference (trainer/model/reference.py)
under no_grad in the same step, before the policy's forward.

Reduction (the contract of trainer/model/objective.py): the loss of a micro-batch is the sum of its
pairs' losses, plus `sft_weight` x the chosen tokens' negative log-likelihood scaled by pairs / chosen
tokens of the whole step, so that after the loop divides by the step's pairs the SFT term is the
chosen tokens' mean over the step (TRL's `sft` loss, CPO's `cpo_alpha`; ORPO's own NLL term). Neither
depends on how the step's pairs are split over micro-batches or ranks.

With a fresh adapter (LoRA B = 0) policy and reference are the same function, so every pair's DPO
sigmoid loss at step 1 is exactly ln 2 (tests/test_preference_drill.py checks the logged loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trainer.config import TrainConfig, runs_reference
from trainer.model.loss import labelled_hidden, token_logprobs
from trainer.model.objective import CHOSEN_TOKENS, PAIRS, Counts
from trainer.model.reference import reference_forward

STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")
"""What each objective sums over its pairs (TRL's names); `rewards/margins` is chosen minus rejected."""


@dataclass(frozen=True)
class Preference:
    """One preference objective with its settings (train.beta, dpo_loss, label_smoothing, sft_weight, simpo_gamma)."""

    kind: str
    """`dpo`, `orpo` or `simpo`."""
    beta: float
    dpo_loss: str = "sigmoid"
    label_smoothing: float = 0.0
    sft_weight: float = 0.0
    simpo_gamma: float = 0.5
    stats: tuple[str, ...] = STATS

    @classmethod
    def of(cls, t: TrainConfig) -> Preference:
        sft = 1.0 if t.objective == "orpo" else t.sft_weight  # ORPO's NLL term is part of it (weight 1)
        return cls(t.objective, t.beta, t.dpo_loss, t.label_smoothing, sft, t.simpo_gamma)

    @property
    def needs_reference(self) -> bool:
        return runs_reference(self.kind)

    def normaliser(self, counts: torch.Tensor) -> torch.Tensor:
        return counts[PAIRS]

    def loss(
        self, model: torch.nn.Module, micro: dict[str, Any], counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = micro["seq_lengths"]  # host ints: the split sizes; their tensor came with the micro-batch
        assert sum(lengths) == micro["label_targets"].numel(), "every labelled token belongs to one sequence"
        reference = None
        if self.needs_reference:
            # Every rank runs it, fillers included: a DDP forward may broadcast buffers (a collective).
            with torch.no_grad(), reference_forward(model):
                reference = sequence_sums(_token_logprobs(model, micro), lengths)
        token_logp = _token_logprobs(model, micro)
        logps = sequence_sums(token_logp, lengths)
        losses, chosen_r, rejected_r, shown = self.pair_terms(logps, micro["seq_tokens"].float(), reference)
        # A micro-batch without pairs (a rank's filler) still backpropagates a zero through the model.
        loss = losses.sum() if lengths else token_logp.sum()
        if self.sft_weight:
            chosen_nll = -logps[0::2].sum()
            loss = loss + self.sft_weight * chosen_nll * counts[PAIRS] / counts[CHOSEN_TOKENS].clamp(min=1)
        sums = (chosen_r.sum(), rejected_r.sum(), (chosen_r > rejected_r).sum(), shown[0].sum(), shown[1].sum())
        return loss, torch.stack([x.detach().double() for x in sums])

    def pair_terms(
        self, logps: torch.Tensor, tokens: torch.Tensor, reference: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(loss per pair, chosen rewards, rejected rewards, (chosen, rejected) log-probs as logged) from
        per-sequence summed log-probs (chosen, rejected interleaved), their token counts and, for DPO, the
        reference's. TRL's definitions, term for term."""
        chosen, rejected = logps[0::2], logps[1::2]
        n_chosen, n_rejected = tokens[0::2], tokens[1::2]
        beta, eps = self.beta, self.label_smoothing
        if self.kind == "dpo":
            assert reference is not None
            chosen_ratio, rejected_ratio = chosen - reference[0::2], rejected - reference[1::2]
            delta = chosen_ratio - rejected_ratio
            if self.dpo_loss == "sigmoid":
                losses = -F.logsigmoid(beta * delta)
            elif self.dpo_loss == "hinge":
                losses = torch.relu(1 - beta * delta)
            elif self.dpo_loss == "ipo":  # per-token log-ratios (TRL's normalisation, agreed with IPO's authors)
                losses = (
                    chosen_ratio / n_chosen.clamp(min=1) - rejected_ratio / n_rejected.clamp(min=1) - 1 / (2 * beta)
                ) ** 2
            else:  # robust: unbiased under a share `eps` of flipped labels
                losses = ((eps - 1) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
            return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), (chosen, rejected)
        # Reference-free: per-token mean log-probs.
        chosen_avg, rejected_avg = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
        if self.kind == "orpo":
            log_odds = (chosen_avg - rejected_avg) - (_log1mexp(chosen_avg) - _log1mexp(rejected_avg))
            losses = -beta * F.logsigmoid(log_odds)
        else:  # simpo
            margin = chosen_avg - rejected_avg - self.simpo_gamma / beta
            losses = -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
        shown = (chosen_avg, rejected_avg)
        return losses, beta * chosen_avg.detach(), beta * rejected_avg.detach(), shown

    def report(self, stats: list[float], counts: Counts) -> dict[str, float]:
        pairs = counts.pairs
        if not pairs:
            return {}
        means = {name: value / pairs for name, value in zip(STATS, stats, strict=True)}
        means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
        # The step's pairs: packing puts a varying number in each row, so a step of fixed rows trains on a
        # varying number of pairs (the estimate prints their mean).
        means["pairs"] = float(pairs)
        return means


KTO_STATS = (
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "logps/rejected",
    "desirable",
    "kl",
)
"""What KTO sums over its units (TRL's names: `chosen` is desirable, `rejected` undesirable); `kl` is each
micro-batch's KL estimate times its units (reported as their mean per unit)."""


@dataclass(frozen=True)
class Kto:
    """KTO as TRL's KTOTrainer defines it (`loss_type: kto`): per unit (an answer with its label), the
    answer's log-ratio r = log p(y|x) - log p_ref(y|x) against the reference point z0, the KL estimate:

        desirable:   desirable_weight   x (1 - sigmoid(beta x (r - z0)))
        undesirable: undesirable_weight x (1 - sigmoid(beta x (z0 - r)))

    z0 = max(0, mean over the micro-batch's KL sequences of their log-ratio), detached: the KL sequences
    (each unit's prompt with another unit's completion, fixed at prepare time: trainer/data/unpaired.py) are
    scored under the policy and the reference in the same forwards as the answers. TRL estimates z0 per
    forward batch (its micro-batch, gathered over processes); here it is per micro-batch on each rank. The
    loss is the sum over the units, which the loop divides by the step's units (TRL: the mean over the
    batch), so with one micro-batch per step on one device both are the same figure; with several, each
    micro-batch's units see their own z0, as in TRL with gradient accumulation."""

    beta: float
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    stats: tuple[str, ...] = KTO_STATS

    @classmethod
    def of(cls, t: TrainConfig) -> Kto:
        return cls(t.beta, t.desirable_weight, t.undesirable_weight)

    def normaliser(self, counts: torch.Tensor) -> torch.Tensor:
        return counts[PAIRS]

    def loss(
        self, model: torch.nn.Module, micro: dict[str, Any], counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = micro["seq_lengths"]  # answer, KL sequence, answer, KL sequence...
        assert sum(lengths) == micro["label_targets"].numel(), "every labelled token belongs to one sequence"
        with torch.no_grad(), reference_forward(model):  # every rank, fillers included (see Preference.loss)
            reference = sequence_sums(_token_logprobs(model, micro), lengths)
        token_logp = _token_logprobs(model, micro)
        logps = sequence_sums(token_logp, lengths)
        if not lengths:  # a rank's filler: a zero through the model
            zero = token_logp.sum()
            return zero, torch.zeros(len(self.stats), device=zero.device, dtype=torch.float64)
        losses, rewards, kl = self.unit_terms(logps, reference, micro["desirable"])
        good = micro["desirable"].to(rewards.dtype)  # masks as weights: boolean indexing would sync the host
        answers = logps[0::2].detach()
        sums = (
            (rewards * good).sum(),
            (rewards * (1 - good)).sum(),
            (answers * good).sum(),
            (answers * (1 - good)).sum(),
            good.sum(),
            kl * good.numel(),
        )
        return losses.sum(), torch.stack([x.detach().double() for x in sums])

    def unit_terms(
        self, logps: torch.Tensor, reference: torch.Tensor, desirable: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss per unit, reward per unit, the KL estimate z0) from per-sequence summed log-probs (answer,
        KL sequence interleaved), the reference's, and each unit's label. TRL's `_compute_loss`, term for term."""
        ratio = logps[0::2] - reference[0::2]
        kl = (logps[1::2].detach() - reference[1::2]).mean().clamp(min=0)
        desired = self.desirable_weight * (1 - torch.sigmoid(self.beta * (ratio - kl)))
        undesired = self.undesirable_weight * (1 - torch.sigmoid(self.beta * (kl - ratio)))
        return torch.where(desirable, desired, undesired), self.beta * ratio.detach(), kl

    def report(self, stats: list[float], counts: Counts) -> dict[str, float]:
        units = counts.pairs
        if not units:
            return {}
        named = dict(zip(KTO_STATS, stats, strict=True))
        good = int(round(named["desirable"]))
        bad = units - good
        out = {"kl": named["kl"] / units, "examples": float(units), "desirable": float(good)}
        for side, n in (("chosen", good), ("rejected", bad)):
            if n:
                out[f"rewards/{side}"] = named[f"rewards/{side}"] / n
                out[f"logps/{side}"] = named[f"logps/{side}"] / n
        if good and bad:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


SIMPO_BETA = (2.0, 10.0)
"""SimPO's beta in its paper's settings: 2 to 2.5 for Mistral and Llama 3, 10 for Gemma 2."""
SIMPO_GAMMA_OVER_BETA = (0.1, 0.8)
"""SimPO's target margin gamma / beta (in mean log-prob) in its paper's settings: mostly about 0.5."""


def regime_notes(train: TrainConfig) -> list[str]:
    """Warnings for settings outside the regime an objective was published and tuned in (said at the run's
    start): SimPO's beta and gamma default to TRL's CPO values (beta 0.1, gamma 0.5), which put a target
    margin of 5 nats per token, 10x the paper's, on a loss 20x flatter."""
    if train.objective != "simpo":
        return []
    ratio = train.simpo_gamma / train.beta
    low, high = SIMPO_BETA
    if low <= train.beta <= high and SIMPO_GAMMA_OVER_BETA[0] <= ratio <= SIMPO_GAMMA_OVER_BETA[1]:
        return []
    return [
        f"train.beta={train.beta:g} and train.simpo_gamma={train.simpo_gamma:g} (gamma/beta {ratio:.2g}) are outside "
        f"SimPO's published regime (beta {low:g} to 2.5, {high:g} for Gemma 2; gamma/beta {SIMPO_GAMMA_OVER_BETA[0]:g} "
        f"to {SIMPO_GAMMA_OVER_BETA[1]:g}, about 0.5 for most models); the paper's Llama 3 Instruct setting is "
        "train.beta=2.5 train.simpo_gamma=1.375"
    ]


def sequence_sums(token_logp: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per-sequence sums of per-token values laid out sequence after sequence: each summed on its own,
    the same bits whatever else the micro-batch holds (no atomics: deterministic on a GPU too)."""
    if not lengths:
        return token_logp.new_zeros(0)
    return torch.stack([part.sum() for part in token_logp.split(lengths)])


def _token_logprobs(model: torch.nn.Module, micro: dict[str, Any]) -> torch.Tensor:
    hidden, head = labelled_hidden(model, micro)
    return token_logprobs(hidden, head.weight, micro["label_targets"], getattr(head, "bias", None))


_LOG1MEXP_EDGE = 1.2e-7
"""How close to 0 a mean log-prob enters ORPO's log(1 - exp(x)): float32's epsilon, below which exp(x) is 1."""


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0 (Maechler's rule), with a finite value and gradient at both ends.

    torch.where evaluates both branches and backpropagates through both (the unused one times 0, and
    0 x inf is NaN), so each branch gets inputs where it is finite: near 0 `log1p(-exp(x))` is log(0),
    far below it `log(-expm1(x))` loses nothing but is kept on its own side all the same. A mean
    log-prob above -`_LOG1MEXP_EDGE` (every answer token all but certain: x = 0 gives log 0) is taken
    as that edge, where the value is finite (-16) and the slope 1/x (8e6) leaves a finite gradient
    whatever multiplies it; the odds term's gradient is 0 there, the NLL term still trains."""
    x = x.clamp(max=-_LOG1MEXP_EDGE)
    near = x > -math.log(2)
    safe_near, safe_far = torch.where(near, x, -1.0), torch.where(near, -1.0, x)
    return torch.where(near, torch.log(-torch.expm1(safe_near)), torch.log1p(-torch.exp(safe_far)))
