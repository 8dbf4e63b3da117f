"""Which files of a folder (a local one, or a hub dataset's listing) hold a subset's split, as
`datasets.load_dataset` resolves them: asked of `datasets.load_dataset_builder` itself, never
re-implemented. So the dataset card's `configs:` (a subset's `data_files`, its `default`), the
data-file patterns (`data/train-00000-of-00002.parquet`, a `test/` folder), the split synonyms
(`training.jsonl` and `dev.jsonl` are train and validation), which files a folder's format keeps
(the most common data format: a folder is one format) and `*` not crossing folders are datasets'
rules, and a split a run reads is the one `load_dataset(path, subset, split=...)` would read.

One addition: without a card `configs:` entry of that name, `data.subset` names a folder
(`<subset>/` or `data/<subset>/`), read as `load_dataset(path, data_dir=subset)` reads it.

A hub dataset is resolved before its data is downloaded: its file listing (the hub's, or the
cache's when offline) is laid out as empty files beside the real card in a scratch folder, the
split's files are resolved there, and only those are fetched (sources.locate).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.data.read import DATA_ENDINGS, DataError

CARD = "README.md"
METADATA = (CARD, ".huggingface.yaml")
"""The files whose YAML `datasets` reads the `configs:` from (read for real; the rest is listed only)."""


def split_files(root: Path, subset: str | None, split: str, key: str, where: str | None = None) -> list[Path]:
    """The data files of `subset`'s `split` under `root`, in datasets' order; never empty."""
    where = where or str(root)
    builder = _builder(root, subset, key, where)
    found = {str(name): [Path(f) for f in files] for name, files in (builder.config.data_files or {}).items()}
    if split not in found:
        raise DataError(
            f"{key}: {where}{_subset(subset)} has no split {split!r} (splits: {', '.join(found) or 'none'}); "
            "set the split to one of them."
        )
    return found[split]


def split_files_listed(
    listing: Iterable[str], metadata: Path, subset: str | None, split: str, key: str, where: str
) -> list[str]:
    """`split_files` of a repository known by its file listing (relative paths) and the folder
    `metadata` holding its card: the split's files as relative paths, resolved on empty stand-ins."""
    with tempfile.TemporaryDirectory(prefix="spotune-layout-") as scratch:
        root = Path(scratch)
        for rel in listing:
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            source = metadata / rel
            target.write_bytes(source.read_bytes() if rel in METADATA and source.is_file() else b"")
        return [f.relative_to(root).as_posix() for f in split_files(root, subset, split, key, where)]


def _builder(root: Path, subset: str | None, key: str, where: str) -> Any:
    """datasets' builder of `root` for `subset`: its config holds the resolved data files per split."""
    import datasets
    from datasets.data_files import EmptyDatasetError
    from datasets.exceptions import DataFilesNotFoundError

    data_dir = None
    if subset is not None and subset not in _card_configs(root):
        data_dir = next((d for d in (subset, f"data/{subset}") if (root / d).is_dir()), None)
        if data_dir is None:
            folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
            raise DataError(
                f"{key}: {where} has no subset {subset!r} (no card `configs:` entry and no {subset}/ folder; "
                f"subsets: {', '.join(_card_configs(root)) or 'none'}; folders: {', '.join(folders) or 'none'}); "
                "set the subset to one of them or unset it."
            )
    with tempfile.TemporaryDirectory(prefix="spotune-builder-") as cache:  # nothing lands in the user's HF cache
        try:
            return datasets.load_dataset_builder(
                str(root), name=None if data_dir else subset, data_dir=data_dir, cache_dir=cache
            )
        except (EmptyDatasetError, DataFilesNotFoundError, FileNotFoundError) as e:
            raise DataError(
                f"{key}: {where}{_subset(subset)} holds no data file datasets reads ({e}; spotune reads "
                f"{', '.join(DATA_ENDINGS)}); with HF_HUB_OFFLINE=1 the cache may lack them: run once online."
            ) from None
        except ValueError as e:  # a subset the card does not list, or several and none chosen
            configs = _card_configs(root)
            if subset is None and len(configs) > 1:
                raise DataError(
                    f"{key}: {where} has several subsets ({', '.join(configs)}); set the subset to one of them."
                ) from None
            raise DataError(f"{key}: {where}: {str(e).splitlines()[0]}; set the subset to one it lists.") from None


def _card_configs(root: Path) -> list[str]:
    """The subset names the card's `configs:` lists (datasets' own reading of its YAML)."""
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard, DatasetCardData

    card = root / CARD
    try:
        data = DatasetCard.load(card).data if card.is_file() else DatasetCardData()
    except Exception:  # a card whose YAML does not parse lists no configs; datasets says the same when it reads it
        return []
    try:
        return list(MetadataConfigs.from_dataset_card_data(data))
    except ValueError as e:  # datasets refuses the card's configs: (its message shows the forms it takes)
        raise DataError(f"{card}: its `configs:` are not what datasets reads: {str(e).strip()}") from None


def _subset(subset: str | None) -> str:
    return f" subset {subset!r}" if subset else ""
