"""Imported once by the forkserver of tests/warm_start.py: what a drill's `python -m trainer train`
imports, the way it imports it, so that every attempt forked from there starts with its imports done."""

import sys

import datasets  # noqa: F401  (a run that prepares its data reads it with datasets)
import torch.distributed.run  # noqa: F401  (torchrun's launcher)
import transformers.models.auto.tokenization_auto  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401  (the drills' tiny model)
from warm_start import TRACKERS

import trainer.catalog  # noqa: F401
import trainer.cli.main  # noqa: F401
import trainer.cli.train  # noqa: F401
import trainer.data.show  # noqa: F401
import trainer.model.preference  # noqa: F401
import trainer.model.reference  # noqa: F401
import trainer.report.page  # noqa: F401
import trainer.training.run  # noqa: F401
from trainer.model.load import bitsandbytes_only_if_loaded

with bitsandbytes_only_if_loaded():  # as a plain LoRA run imports peft: bitsandbytes not loaded
    import peft  # noqa: F401

# Their settings may differ from the forkserver's environment only while they are not imported here.
assert not any(tracker in sys.modules for tracker in TRACKERS)
