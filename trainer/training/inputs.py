"""What a run reads, resolved from its config: the base model's path, the tokenizer's, the packed data.

The built-in assets (`builtin:tiny-llama`, `builtin:tiny-instruct`) resolve to files built offline
(trainer/builtin_assets.py); data preparation is cached by content (trainer/data/cache.py). A hub
dataset is read at the commit the run's first start resolved it to (`pin_data`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from trainer import builtin_assets
from trainer import config as C
from trainer.data.cache import data_cache_root


def model_path(cfg: C.RunConfig) -> str:
    return builtin_assets.resolve_model(cfg.model.name_or_path)


def tokenizer_path(cfg: C.RunConfig) -> str:
    return cfg.data.tokenizer or model_path(cfg)


def pin_data(cfg: C.RunConfig, is_main: bool = True) -> C.RunConfig:
    """`cfg` with every hub dataset's revision a commit: the one the run directory's config.yaml
    holds (written on the run's first start; on a fresh machine fetched from checkpoint.remote
    before this runs), else the one the hub names now. Rank 0 resolves; every rank gets its answer,
    so all nodes read the same commit. The pinned config is what config.yaml and every checkpoint
    record (trainer/training/run.py writes them)."""
    from trainer.data.sources import pin_revisions

    pinned: C.RunConfig | None = None
    if is_main:
        saved = saved_config(Path(cfg.output_dir))
        data, notes = pin_revisions(cfg.data, saved.data if saved is not None else None)
        pinned = dataclasses.replace(cfg, data=data)
        for note in notes:
            print(f"spotune: {note}", flush=True)
    import torch  # here: `spotune prepare` needs no torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        box = [pinned]
        torch.distributed.broadcast_object_list(box, src=0)
        pinned = box[0]
    assert pinned is not None
    return pinned


def saved_config(run_dir: Path) -> C.RunConfig | None:
    """The run's config.yaml as its first start wrote it, read through the config loader; None if absent."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        return C.from_dict(yaml.safe_load(path.read_text()) or {}, source=str(path))
    except (C.ConfigError, yaml.YAMLError) as e:  # written by another spotune version: nothing to pin from
        print(f"spotune: {path} does not load ({str(e).splitlines()[0]}); hub datasets resolve anew", flush=True)
        return None


def resolved_data(cfg: C.RunConfig) -> C.DataConfig:
    """`cfg.data` with the built-in dataset names (`builtin:...`) turned into their files."""
    d = cfg.data
    sources = tuple(dataclasses.replace(s, path=builtin_assets.resolve_data(s.path)) for s in d.sources)
    return dataclasses.replace(d, path=builtin_assets.resolve_data(d.path), sources=sources)


def prepare_data(cfg: C.RunConfig, progress: bool = True, full: bool = True) -> Any:
    """Prepare (or reuse) the packed dataset of `cfg`. `progress`: print its summary (the full report;
    with `full=False`, a reused dataset's counts and what seq_len loses) and, on a terminal only,
    datasets' progress bars (in a log file a bar is one long line of carriage returns)."""
    from trainer import data
    from trainer.data.stats import brief_summary
    from trainer.progress import is_terminal

    data_cfg = resolved_data(cfg)
    cache_root = data_cache_root(cfg.data.cache_dir, cfg.output_dir)
    bars = progress and is_terminal()
    prepared = data.prepare(data_cfg, tokenizer_path(cfg), cache_root, progress=bars, seed=cfg.seed)
    if progress:
        where = str(prepared.train_path.parent)
        brief = prepared.reused and not full
        print(brief_summary(prepared.manifest, True, where) if brief else prepared.summary(), flush=True)
    return prepared
