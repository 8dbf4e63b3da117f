"""`train.deterministic`: the settings a bit-identical CUDA run needs, set once, before any kernel runs.

On CPU in fp32 spotune is bit-identical already (a resume equals an uninterrupted run). On a
GPU two uninterrupted runs differed by 6.0e-4 (docs/gpu.md, 1.1B bf16 LoRA on one H100): kernels that
accumulate with atomics (flash attention's dQ, index_put/scatter backward) and cuBLAS's
split-K workspaces sum in whatever order the hardware finishes. Deterministic mode:

- `torch.use_deterministic_algorithms(True)`: every op with a deterministic variant uses it
  (torch's flash and memory-efficient attention backward included, hence spotune_varlen and
  sdpa), and any op without one raises instead of silently differing;
- `CUBLAS_WORKSPACE_CONFIG=:4096:8`: cuBLAS's fixed-order workspace (set before the first
  cuBLAS handle exists, i.e. before the model reaches the GPU);
- `FLASH_ATTENTION_DETERMINISTIC=1`: the flash-attn package's deterministic backward, which
  transformers passes on for flash_attention_2/3;
- cuDNN deterministic and without benchmark autotuning (a data-dependent kernel choice).

Refused, with the reason, by the config rules (trainer/config/rules.py): `model.compile` (Inductor picks Triton kernel configurations by
timing them, so the reduction order can change from one run to the next). What stays true only
for the same device count: a resume on another GPU count reduces in another order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def kernels(deterministic: bool) -> Iterator[list[str]]:
    """Within the block, deterministic kernels only (when `deterministic`); yields notes for the log.

    The switches are process-wide: they are put back afterwards, so a caller that trains in its
    own process (a test, the in-process pilot) keeps its own settings.
    """
    if not deterministic:
        yield []
        return
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "FLASH_ATTENTION_DETERMINISTIC")},
    )
    notes = []
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            notes.append(
                "train.deterministic: CUDA was initialised before CUBLAS_WORKSPACE_CONFIG could be set; "
                f"export CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} before starting for bit-identical matmuls"
            )
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    notes.append(
        "deterministic mode: deterministic kernels only (bit-identical reruns and resumes on the same device count)"
    )
    try:
        yield notes
    finally:
        enabled, warn_only, cudnn_deterministic, cudnn_benchmark, env = previous
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, cudnn_benchmark
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
