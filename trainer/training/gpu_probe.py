"""Whether this machine has an NVIDIA GPU that torch cannot use: never train on the CPU of a GPU box.

A rented GPU machine whose torch is a CPU build, or was built for a newer CUDA than the driver
supports, would otherwise train on its CPU at a hundredth of the speed while the GPU bills.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import torch


def listed_gpus(nvidia_smi: str = "nvidia-smi") -> list[str]:
    """The GPUs `nvidia-smi -L` lists (empty where it is absent or answers nothing)."""
    path = shutil.which(nvidia_smi)
    if path is None:
        return []
    try:
        out = subprocess.run([path, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.stdout.splitlines() if line.startswith("GPU ")] if out.returncode == 0 else []


def unusable_gpu_reason() -> str | None:
    """Why training would fall back to the CPU on a machine with a GPU, or None.

    `CUDA_VISIBLE_DEVICES=""` (or -1) is the documented way to ask for the CPU on purpose.
    """
    if torch.cuda.is_available() or os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return None
    gpus = listed_gpus()
    if not gpus:
        return None
    build = torch.version.cuda
    why = (
        f"torch {torch.__version__} is a CPU build"
        if build is None
        else f"torch {torch.__version__} was built for CUDA {build}, which this driver does not run"
    )
    return (
        f"nvidia-smi lists {gpus[0].split('(UUID')[0].strip()} but {why}, so training would run on the CPU. "
        "Fix: rm -rf .venv && make setup (it installs the build your driver supports), or update the NVIDIA "
        'driver; to train on the CPU on purpose, set CUDA_VISIBLE_DEVICES="".'
    )
