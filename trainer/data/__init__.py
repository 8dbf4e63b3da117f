"""Data preparation: read rows -> template -> tokenise once -> pack -> cached Arrow dataset.

Public API: `prepare(cfg, tokenizer_path, cache_root, *, progress=True, seed=0) -> Prepared`.
"""

from trainer.data.cache import PIPELINE_VERSION
from trainer.data.prepare import Prepared, prepare
from trainer.data.read import DataError

__all__ = ["PIPELINE_VERSION", "DataError", "Prepared", "prepare"]
