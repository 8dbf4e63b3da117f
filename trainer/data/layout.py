"""Which files of a folder (a local one, or a hub dataset's snapshot) hold a subset's split.

The rules, simplest first, follow the hub's own conventions:

1. The dataset card (README.md) lists `configs:` in its YAML header: the subset is the entry whose
   `config_name` is `data.subset` (unset: the one marked `default: true`, else the only one, else
   `default`), and its `data_files` name the split's files by glob patterns. A pattern list with
   no split names the `train` split.
2. Otherwise every data file (.jsonl .ndjson .json .parquet .csv) under the folder counts; with
   `data.subset` set, only those under `<subset>/` (or `data/<subset>/`). A file belongs to a split
   when a folder on its path is named by it (`test/part-0.parquet`) or its name carries it as a
   word (`data/train-00000-of-00002.parquet`, `my_validation.jsonl`). When no file carries any
   split word, every file is the `train` split.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.data.read import DATA_ENDINGS, DataError, data_suffix

CARD = "README.md"
SPLIT_WORDS = ("train", "training", "test", "testing", "validation", "valid", "val", "dev", "eval", "evaluation")
_IGNORED_DIRS = (".git", ".cache", ".huggingface")


def card_patterns(card: Path, subset: str | None, split: str, where: str, key: str) -> list[str] | None:
    """The split's glob patterns from the card's `configs:`, or None when the card lists none."""
    configs = _card_configs(card)
    if not configs:
        return None
    entry = _choose_config(configs, subset, where, key)
    data_files = entry.get("data_files")
    if data_files is None:
        return None  # a config without data_files (builder options only): fall back to the folder layout
    by_split = _by_split(data_files)
    if split not in by_split:
        raise DataError(
            f"{key}: {where} subset {entry.get('config_name')!r} has no split {split!r} "
            f"(splits: {', '.join(by_split)}); set the split to one of them."
        )
    return by_split[split]


def pick_files(root: Path, subset: str | None, split: str, key: str, where: str | None = None) -> list[Path]:
    """The data files of `subset`'s `split` under `root`, sorted by path; never empty."""
    where = where or str(root)
    files = _data_files(root)
    patterns = card_patterns(root / CARD, subset, split, where, key) if (root / CARD).is_file() else None
    if patterns is not None:
        rels = {f: f.relative_to(root).as_posix() for f in files}
        chosen = [f for f in files if any(_match(rels[f], pat) for pat in patterns)]
        if not chosen:
            raise DataError(
                f"{key}: {where}: no data file matches the card's patterns for split {split!r} "
                f"({', '.join(patterns)}); with HF_HUB_OFFLINE=1 the cache may lack them: run once online."
            )
        return chosen
    if subset is not None:
        under = [f for f in files if _under(f.relative_to(root), subset)]
        if not under:
            folders = sorted({f.relative_to(root).parts[0] for f in files if len(f.relative_to(root).parts) > 1})
            raise DataError(
                f"{key}: {where} has no subset {subset!r} (no card `configs:` entry and no {subset}/ folder; "
                f"folders: {', '.join(folders) or 'none'}); set the subset to one of them or unset it."
            )
        files = under
    if not files:
        raise DataError(
            f"{key}: {where} holds no data file ({', '.join(DATA_ENDINGS)}); with HF_HUB_OFFLINE=1 the "
            "cache may lack them: run once online."
        )
    named = {f: _splits_named(f.relative_to(root)) for f in files}
    if not any(named.values()):
        if split == "train":
            return files
        raise DataError(
            f"{key}: {where}: no file is named for split {split!r} (all {len(files)} files are the train split); "
            "set the split to train."
        )
    chosen = [f for f in files if split in named[f]]
    if not chosen:
        found = sorted({s for v in named.values() for s in v})
        raise DataError(f"{key}: {where} has no split {split!r} (splits: {', '.join(found)}); set the split to one.")
    return chosen


def _data_files(root: Path) -> list[Path]:
    out = []
    for f in root.rglob("*"):
        rel = f.relative_to(root)
        if any(part in _IGNORED_DIRS or part.startswith(".") for part in rel.parts):
            continue
        if f.is_file() and data_suffix(f) is not None:
            out.append(f)
    return sorted(out, key=lambda f: f.relative_to(root).as_posix())


def _under(rel: Path, subset: str) -> bool:
    parts = rel.parts
    return (len(parts) > 1 and parts[0] == subset) or (len(parts) > 2 and parts[:2] == ("data", subset))


def _splits_named(rel: Path) -> set[str]:
    """The split words a file's folders or name carry."""
    words = {p.lower() for p in rel.parts[:-1]}
    words |= {w for w in re.split(r"[-._ 0-9]+", rel.name.lower()) if w}
    return words & set(SPLIT_WORDS)


def _match(rel: str, pattern: str) -> bool:
    """fnmatch, where `*` crosses folders (as the hub's own filter does) and `**/` may match none."""
    pattern = pattern.lstrip("./")
    return fnmatch.fnmatch(rel, pattern) or (pattern.startswith("**/") and fnmatch.fnmatch(rel, pattern[3:]))


def _card_configs(card: Path) -> list[dict[str, Any]]:
    if not card.is_file():
        return []
    from huggingface_hub import metadata_load

    try:
        meta = metadata_load(card) or {}
    except Exception:  # a card whose YAML header does not parse names no configs; the folder rules apply
        return []
    configs = meta.get("configs")
    return [dict(c) for c in configs if isinstance(c, Mapping)] if isinstance(configs, list) else []


def _choose_config(configs: list[dict[str, Any]], subset: str | None, where: str, key: str) -> dict[str, Any]:
    names = [str(c.get("config_name", "default")) for c in configs]
    if subset is not None:
        if subset not in names:
            raise DataError(f"{key}: {where} has no subset {subset!r} (subsets: {', '.join(names)}); set it to one.")
        return configs[names.index(subset)]
    marked = [c for c in configs if c.get("default")]
    if marked:
        return marked[0]
    if len(configs) == 1:
        return configs[0]
    if "default" in names:
        return configs[names.index("default")]
    raise DataError(f"{key}: {where} has several subsets ({', '.join(names)}); set the subset to one of them.")


def _by_split(data_files: Any) -> dict[str, list[str]]:
    """The card's `data_files` as split -> patterns (a bare pattern or list of them is `train`)."""
    if isinstance(data_files, str):
        return {"train": [data_files]}
    if isinstance(data_files, Mapping) and "path" not in data_files:  # {split: pattern(s)}
        return {str(k): [v] if isinstance(v, str) else list(v) for k, v in data_files.items()}
    out: dict[str, list[str]] = {}
    for item in data_files if isinstance(data_files, list) else [data_files]:
        if isinstance(item, str):
            out.setdefault("train", []).append(item)
        elif isinstance(item, Mapping):
            paths = item.get("path", [])
            out.setdefault(str(item.get("split", "train")), []).extend([paths] if isinstance(paths, str) else paths)
    return out
