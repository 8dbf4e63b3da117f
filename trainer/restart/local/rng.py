"""Every random generator a run draws from (python, numpy, torch CPU, each CUDA device), per rank.

Saved as `rng.safetensors`: `rank<r>.python.*` (int64/float64), `rank<r>.numpy.*`,
`rank<r>.torch.cpu` and `rank<r>.cuda.<device>` (uint8, torch's own byte encoding).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def capture_rng() -> dict[str, torch.Tensor]:
    """This process's python, numpy, torch CPU and every CUDA device's generator state."""
    version, internal, gauss_next = random.getstate()
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    out = {
        "python.version": torch.tensor([version], dtype=torch.int64),
        "python.state": torch.tensor(internal, dtype=torch.int64),
        # [has value, value]: random.gauss keeps a spare draw between calls.
        "python.gauss_next": torch.tensor([0.0, 0.0] if gauss_next is None else [1.0, gauss_next], dtype=torch.float64),
        "numpy.keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy.pos_has_gauss": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "numpy.cached_gaussian": torch.tensor([cached_gaussian], dtype=torch.float64),
        "torch.cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        for i, st in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda.{i}"] = st
    return out


def restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `capture_rng`: the next draws of every generator repeat the captured ones."""
    gauss = tensors["python.gauss_next"].tolist()
    random.setstate(
        (
            int(tensors["python.version"][0]),
            tuple(int(x) for x in tensors["python.state"].tolist()),
            gauss[1] if gauss[0] else None,
        )
    )
    pos, has_gauss = (int(x) for x in tensors["numpy.pos_has_gauss"].tolist())
    np.random.set_state(
        (
            "MT19937",
            tensors["numpy.keys"].numpy().astype(np.uint32),
            pos,
            has_gauss,
            float(tensors["numpy.cached_gaussian"][0]),
        )
    )
    torch.set_rng_state(tensors["torch.cpu"].to(torch.uint8).contiguous())
    cuda = sorted((int(k.split(".")[1]), v) for k, v in tensors.items() if k.startswith("cuda."))
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            log.warning(
                "checkpoint holds RNG state for %d CUDA devices, this process sees %d",
                len(cuda),
                torch.cuda.device_count(),
            )
        for i, st in cuda[: torch.cuda.device_count()]:
            torch.cuda.set_rng_state(st.to(torch.uint8), device=i)


def gather_rng(world_size: int) -> dict[str, torch.Tensor]:
    """Every rank's `capture_rng()`, keyed `rank<r>.<name>`. Collective: all ranks must call it."""
    local = capture_rng()
    if world_size == 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return {f"rank0.{k}": v for k, v in local.items()}
    # all_gather_object pickles over the process group only; nothing pickled reaches disk.
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, {k: v.numpy() for k, v in local.items()})
    return {f"rank{r}.{k}": torch.from_numpy(v) for r, d in enumerate(gathered) for k, v in d.items()}


def rank_rng(
    tensors: dict[str, torch.Tensor], rank: int, saved_world_size: int, world_size: int
) -> dict[str, torch.Tensor] | None:
    """This rank's saved generators, or None when they cannot apply (the world size changed)."""
    prefix = f"rank{rank}."
    mine = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    if mine and world_size == saved_world_size:
        return mine
    return None


def reseed(seed: int, step: int, rank: int) -> None:
    """Fresh, distinct streams per rank when the saved RNG cannot apply (world size changed)."""
    words = np.random.SeedSequence([seed, step, rank]).generate_state(2)
    random.seed(int(words[0]))
    np.random.seed(int(words[0]))
    torch.manual_seed(int(words[0]) << 32 | int(words[1]))
