"""Loss of a micro-batch: decoder forward, head at labelled positions, summed cross-entropy.

Convention (what must stay true):
- labels are aligned with input_ids; logits[:, :-1] predict labels[:, 1:]; IGNORE_INDEX
  (-100) is ignored.
- the result is a *sum* over the micro-batch's trainable tokens; the loop divides by the
  step's trainable tokens over every micro-batch and rank.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from trainer.data.template import IGNORE_INDEX


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the causal LM's forward takes `logits_to_keep` (transformers' own models do;
    some remote-code models do not, and then every position gets logits)."""
    while hasattr(model, "module"):
        model = model.module
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def token_loss_sum(model: torch.nn.Module, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over the micro-batch's trainable tokens.

    No attention_mask and use_cache=False: with position_ids alone transformers builds the
    block-diagonal causal mask of the packed documents.

    With `keep`/`keep_labels` (see `logit_positions`) the vocabulary projection runs only
    at positions that carry a label, a large saving in SFT where prompts are masked; the
    sum is the same, since masked positions contribute nothing to loss or gradient.
    """
    if "keep" in micro:
        logits = model(
            input_ids=micro["input_ids"],
            position_ids=micro["position_ids"],
            use_cache=False,
            logits_to_keep=micro["keep"],
        ).logits
        labels = micro["keep_labels"]
    else:
        logits = model(input_ids=micro["input_ids"], position_ids=micro["position_ids"], use_cache=False).logits
        logits = logits[:, :-1]
        labels = micro["labels"][:, 1:]
    logits = logits.float()  # the loss in fp32 whatever the compute dtype
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
