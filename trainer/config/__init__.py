"""The run configuration: `RunConfig`, YAML recipes, dotted overrides, the global-batch rule
and the fingerprint a resumed run must match.

The sections and their defaults are trainer/config/schema.py (defaults live there and nowhere
else); building with type checks and the cross-field rules are rules.py, which reads the
sections and never this module, so the three import one way. `load(recipe, overrides)` reads a
YAML recipe, applies `key.sub=value` overrides, checks every key and type, and raises one
`ConfigError` that lists every problem, each naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.config import aliases, rules
from trainer.config.rules import build, cross_checks, plain
from trainer.config.schema import (
    BUILTIN_TINY_DATA,
    BUILTIN_TINY_MODEL,
    AdapterConfig,
    CheckpointConfig,
    DataConfig,
    MetricsConfig,
    ModelConfig,
    SourceConfig,
    TrainConfig,
)
from trainer.config.source import Marks, SourceError, locate, read_overrides, read_recipe
from trainer.exit_codes import EXIT_BAD_INPUT

_log = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_TINY_DATA",
    "BUILTIN_TINY_MODEL",
    "AdapterConfig",
    "BatchSplit",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "MetricsConfig",
    "ModelConfig",
    "RunConfig",
    "SourceConfig",
    "TrainConfig",
    "batch_split",
    "diff_structural",
    "field_docs",
    "fingerprint",
    "from_dict",
    "load",
    "structural_fields",
    "to_yaml",
]


@dataclass(frozen=True)
class RunConfig:
    output_dir: str = "runs/default"
    """Run directory: checkpoints, metrics, ledger, final adapter."""
    seed: int = 0
    """Seed for initialisation, LoRA dropout and the data order."""
    model: ModelConfig = field(default_factory=ModelConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def to_dict(self) -> dict[str, Any]:
        return plain(dataclasses.asdict(self))

    def replace(self, **dotted: Any) -> RunConfig:
        """A copy with dotted keys changed, validated like overrides: `cfg.replace(**{"train.max_steps": 5})`."""
        return from_dict(_apply_overrides(self.to_dict(), dotted, source="replace()"))


class ConfigError(ValueError):
    """Every problem found in a config, one per line, each naming the key and the fix."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, problems: Sequence[str], source: str = "config") -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}")


# ---------------------------------------------------------------------------- loading


def load(recipe: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML recipe (or the defaults when None) and apply `key.sub=value` overrides.

    Every problem names where the setting came from: `recipe.yaml:LINE: key: ...` or
    `override key=value: key: ...`; known Hugging Face / Axolotl names are read as spotune's (aliases.py).
    """
    source = str(recipe) if recipe is not None else "defaults"
    raw: dict[str, Any] = {}
    marks: Marks = {}
    if recipe is not None:
        try:
            raw, marks = read_recipe(Path(recipe))
        except SourceError as e:
            raise ConfigError(e.problems, source) from None
    pairs, over_marks, problems = read_overrides(overrides)
    if problems:
        raise ConfigError(problems, "command line")
    fields = _fields()
    from_recipe, marks, problems = aliases.resolve(_flatten(raw, fields), marks, fields)
    from_line, over_marks, more = aliases.resolve(pairs, over_marks, fields)
    merged = _apply_overrides(_apply_overrides({}, from_recipe, source), from_line, "command line")
    return from_dict(merged, source=source, marks={**marks, **over_marks}, problems=problems + more)


def from_dict(
    raw: Mapping[str, Any], source: str = "config", marks: Marks | None = None, problems: Sequence[str] = ()
) -> RunConfig:
    """Build a RunConfig from nested plain data, collecting every problem before raising (each
    prefixed with where its key was set, when `marks` say; `problems` found earlier come located)."""
    raw, found = _max_length(raw)
    cfg = build(RunConfig, raw, "", found, marks)
    found.extend(cross_checks(cfg))  # fields that failed their type check hold valid defaults here
    if found or problems:
        raise ConfigError([*problems, *(locate(p, marks or {}) for p in found)], source)
    return cfg


def _max_length(raw: Mapping[str, Any]) -> tuple[Mapping[str, Any], list[str]]:
    """`data.max_length` as TRL reads `max_length`: under SFT the sequence length (it becomes `data.seq_len`),
    under a preference objective the cap of each answer's sequence, where a packed row that `data.seq_len` does
    not size holds 2 x max_length (one pair, both answers at their longest). Said in the log."""
    data = raw.get("data")
    if not isinstance(data, Mapping) or not isinstance(data.get("max_length"), int) or data["max_length"] < 1:
        return raw, []  # unset, or a value the schema's check names
    train = raw.get("train")
    train = train if isinstance(train, Mapping) else {}
    n, out = data["max_length"], {**raw, "data": dict(data)}
    if train.get("objective", TrainConfig.objective) == "sft":
        if data.get("seq_len", n) != n:
            return raw, [
                f"data.max_length: is the sequence length under SFT, as data.seq_len={data['seq_len']} is; keep one"
            ]
        out["data"].pop("max_length")
        out["data"]["seq_len"] = n
        _log.warning("config: data.max_length=%d read as data.seq_len (SFT: the length of a sequence)", n)
    elif "seq_len" not in data:
        out["data"]["seq_len"] = 2 * n
        _log.warning(
            "config: data.seq_len = 2 x data.max_length = %d: a packed row holds one pair with both answers at "
            "their longest (data.max_length caps each answer's sequence, as in TRL)",
            2 * n,
        )
    return out, []


def _fields() -> dict[str, frozenset[str]]:
    """ "" -> the top-level keys, and each section -> its keys (what aliases.resolve reads)."""
    out = {"": frozenset(f.name for f in dataclasses.fields(RunConfig))}
    for f in dataclasses.fields(RunConfig):
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            out[f.name] = frozenset(g.name for g in dataclasses.fields(f.default_factory))
    return out


def _flatten(raw: Mapping[str, Any], fields: Mapping[str, frozenset[str]]) -> dict[str, Any]:
    """A recipe's mapping as dotted pairs, one level into each section (deeper mappings stay values)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in fields and key != "" and isinstance(value, Mapping):
            out.update({f"{key}.{sub}": v for sub, v in value.items()})
        elif not (key in fields and value is None):  # an empty section: its defaults
            out[str(key)] = value
    return out


def _apply_overrides(raw: Mapping[str, Any], pairs: Mapping[str, Any], source: str) -> dict[str, Any]:
    out = json.loads(json.dumps(raw, default=list))  # deep copy of plain data
    problems: list[str] = []
    for dotted, value in pairs.items():
        parts = dotted.split(".")
        node = out
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                problems.append(f"{dotted}: {part!r} is a value, not a section")
                break
            node = nxt
        else:
            node[parts[-1]] = value
    if problems:
        raise ConfigError(problems, source)
    return out


# ---------------------------------------------------------------------------- output


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def structural_fields(cfg: RunConfig, world_size: int = 1, global_rows: int | None = None) -> dict[str, Any]:
    """The settings a resumed run must share with the run that wrote the checkpoint."""
    a, d, t = cfg.adapter, cfg.data, cfg.train
    if global_rows is None and t.micro_batch_size == "auto":
        global_rows = t.global_batch_size  # set whenever the micro-batch is `auto` (config rules)
    return {
        "model.name_or_path": cfg.model.name_or_path,
        "model.revision": cfg.model.revision,
        "model.dtype": cfg.model.dtype,
        "adapter.method": a.method,
        "adapter.quant_bits": a.quant_bits if a.method == "qlora" else None,
        "adapter.r": a.r,
        "adapter.alpha": a.alpha,
        "adapter.target_modules": list(a.target_modules),
        "data.path": d.path,
        "data.format": d.format,
        "data.seq_len": d.seq_len,
        "data.packing": d.packing,
        # The global batch defines the run; world size, micro-batch and accumulation do not.
        "global_batch_rows": global_rows if global_rows is not None else batch_split(t, world_size).global_rows,
        "train.optimizer": t.optimizer,  # its saved state only loads into the same optimizer
        # What the adapter is trained towards (None for SFT: the fields SFT checkpoints always recorded).
        "train.objective": t.objective if t.objective != "sft" else None,
    }


def runs_reference(objective: str) -> bool:
    """Whether `train.objective`'s step also runs the reference's forward (dpo and kto; orpo and simpo are
    reference-free). The one answer: the step (trainer/model/preference.py), the starting adapter kept
    frozen as that reference (trainer/training/inputs.py), the meter's MFU and the estimate's FLOPs and
    memory read it."""
    return objective in ("dpo", "kto")


def dropout_off(train: TrainConfig) -> bool:
    """Whether the run trains with every dropout off, the adapter's (whatever `adapter.dropout` says) and the
    model's own: the preference objectives do, as TRL's DPO, ORPO and CPO trainers do by default
    (`disable_dropout`). The policy's forward is then a function of its weights alone: from
    `adapter.init_from` it equals the reference's at step 1, and the loss is TRL's."""
    return train.objective != "sft"


def lora_dropout(cfg: RunConfig) -> float:
    """The LoRA dropout the run trains with (`adapter.dropout` unless `dropout_off`)."""
    return 0.0 if dropout_off(cfg.train) else cfg.adapter.dropout


@dataclass(frozen=True)
class BatchSplit:
    """How an optimizer step's global batch is spread over `world` devices."""

    global_rows: int
    world: int
    micro_batch_size: int

    @property
    def micro_steps(self) -> int:
        """Micro-batches every rank runs per step (ranks with fewer rows run a filler micro-batch)."""
        return -(-self.global_rows // (self.micro_batch_size * self.world))

    def resume_note(self, saved_world: int, dropout: float) -> str:
        """What a resume on another world size keeps, and what it cannot keep identical."""
        same = (
            "with adapter.dropout=0 the result equals a same-size run within floating-point summation order"
            if dropout == 0
            else f"dropout masks (adapter.dropout={dropout:g}) are drawn per rank, so the continuation is "
            "statistically equivalent but not bitwise identical to an uninterrupted run"
        )
        return (
            f"resuming a run checkpointed on {saved_world} process(es) with world size {self.world}: the global "
            f"batch stays {self.global_rows} rows ({self.micro_steps} micro-step(s) of {self.micro_batch_size} "
            f"row(s) per rank), every step trains on the same rows (sample_digest); {same}"
        )


def batch_split(train: TrainConfig, world: int, saved_global_rows: int | None = None) -> BatchSplit:
    """The one rule for the global batch: `train.global_batch_size`, else the resumed run's own,
    else `micro_batch_size x grad_accum x world`. Raises ConfigError when the pieces disagree."""
    micro = train.micro_batch_size
    if micro == "auto":  # trainer/training/autofit.py resolves it before anything splits the batch
        raise ConfigError(["train.micro_batch_size: `auto` must be resolved first (trainer.training.autofit.resolve)"])
    if train.global_batch_size is not None:
        rows = train.global_batch_size
        if train.grad_accum is not None and micro * train.grad_accum * world != rows:
            raise ConfigError(
                [
                    f"train.global_batch_size={rows} but train.micro_batch_size={micro} x train.grad_accum="
                    f"{train.grad_accum} x {world} device(s) = {micro * train.grad_accum * world}: remove "
                    "train.grad_accum (it is derived from the global batch), or make them agree"
                ]
            )
    elif saved_global_rows is not None:
        rows = saved_global_rows  # a resume on another device count keeps the run's global batch
    else:
        rows = micro * (train.grad_accum or 1) * world
    if world > rows:
        raise ConfigError(
            [
                f"{world} devices but a global batch of {rows} rows: every device needs at least one row; "
                f"run on at most {rows} devices or raise train.global_batch_size"
            ]
        )
    return BatchSplit(rows, world, micro)


def fingerprint(cfg: RunConfig, world_size: int = 1) -> str:
    """sha256 over the structural fields; equal fingerprints mean a checkpoint fits this run."""
    blob = json.dumps(structural_fields(cfg, world_size), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def diff_structural(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Readable lines `key: old -> new` for every structural field that differs."""
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


def field_docs() -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every key, for docs/config-reference.md and `spotune config`."""
    return rules.field_docs(RunConfig)
