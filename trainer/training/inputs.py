"""What a run reads, resolved from its config: the base model's path, the tokenizer's, the packed data.

The built-in assets (`builtin:tiny-llama`, `builtin:tiny-instruct`) resolve to files built offline
(trainer/builtin_assets.py); data preparation is cached by content (trainer/data/cache.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainer import builtin_assets
from trainer import config as C
from trainer.data.cache import data_cache_root


def model_path(cfg: C.RunConfig) -> str:
    return builtin_assets.resolve_model(cfg.model.name_or_path)


def tokenizer_path(cfg: C.RunConfig) -> str:
    return cfg.data.tokenizer or model_path(cfg)


def prepare_data(cfg: C.RunConfig, progress: bool = True) -> Any:
    """Prepare (or reuse) the packed dataset of `cfg` and print its summary."""
    from trainer import data

    data_cfg = dataclasses.replace(cfg.data, path=builtin_assets.resolve_data(cfg.data.path))
    cache_root = data_cache_root(cfg.data.cache_dir, cfg.output_dir)
    prepared = data.prepare(data_cfg, tokenizer_path(cfg), cache_root, progress=progress, seed=cfg.seed)
    if progress:
        print(prepared.summary(), flush=True)
    return prepared
