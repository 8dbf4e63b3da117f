"""The run configuration: frozen typed dataclasses, YAML recipes, dotted overrides.

The dataclasses below are the whole schema. Defaults live here and nowhere else.
`load(recipe, overrides)` reads a YAML recipe, applies `key.sub=value` overrides,
checks every key and type, and raises one `ConfigError` that lists every problem,
each naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from trainer.config import rules as config_rules
from trainer.config.rules import build, cross_checks, plain

BUILTIN_TINY_MODEL = "builtin:tiny-llama"
BUILTIN_TINY_DATA = "builtin:tiny-instruct"


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str = BUILTIN_TINY_MODEL
    """Local directory or hub model id of the base model (`builtin:tiny-llama` is built offline)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when `name_or_path` is a model id."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype of the frozen base weights (and the compute dtype of 4-bit layers)."""
    attn_implementation: Literal[
        "auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention", "spotune_varlen"
    ] = "auto"
    """`auto`: on CUDA flash_attention_3/2 if installed, else spotune_varlen (torch's varlen kernel), else flex_attention; sdpa on CPU."""
    compile: bool = False
    """torch.compile each decoder layer (first steps are slower while it compiles)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (non-reentrant) to save memory."""
    trust_remote_code: bool = False
    """Run modelling code shipped with the checkpoint. Off unless you trust its source."""


@dataclass(frozen=True)
class AdapterConfig:
    method: Literal["lora", "qlora"] = "lora"
    """`lora` over a bf16/fp16/fp32 base, or `qlora` over a bitsandbytes-quantised base."""
    quant_bits: Literal[4, 8] = 4
    """For `qlora`: 4 (NF4 with double quantisation) or 8 (LLM.int8)."""
    r: int = 16
    """LoRA rank."""
    alpha: float = 32.0
    """LoRA alpha; the update is scaled by alpha / r."""
    dropout: float = 0.05
    """Dropout on the LoRA input."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Module names to adapt; `all-linear` adapts every linear layer but the output head."""


@dataclass(frozen=True)
class DataConfig:
    path: str = BUILTIN_TINY_DATA
    """JSONL, JSON array, Parquet, CSV file, or a saved `datasets` directory."""
    format: Literal["alpaca", "chat", "text"] = "alpaca"
    """`alpaca` (instruction/input/output), `chat` (messages), `text` (every token trained)."""
    seq_len: int = 2048
    """Tokens per packed row."""
    packing: bool = True
    """Best-fit-decreasing packing; false pads each example to `seq_len`."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """What to do with examples longer than `seq_len`."""
    tokenizer: str | None = None
    """Tokenizer path or id; defaults to `model.name_or_path`."""
    chat_template: str | None = None
    """Jinja chat template for `chat` data when the tokenizer has none."""
    instruction_field: str = "instruction"
    """Field holding the alpaca instruction."""
    input_field: str = "input"
    """Field holding the optional alpaca input (may be missing or empty)."""
    output_field: str = "output"
    """Field holding the alpaca response (trained)."""
    messages_field: str = "messages"
    """Field holding chat messages (`role`/`content`); only assistant turns are trained."""
    text_field: str = "text"
    """Field holding raw text for `text` format."""
    cache_dir: str | None = None
    """Where packed datasets are cached; defaults to `<output_dir>/data`."""
    num_proc: int = 1
    """Processes for tokenisation (`datasets.map`)."""
    eval_fraction: float = 0.0
    """Share of examples held out for evaluation (ignored when `eval_path` is set)."""
    eval_path: str | None = None
    """A separate evaluation file, prepared like `path`."""
    shuffle: bool = True
    """Shuffle rows each epoch (order is a pure function of seed and epoch)."""


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int | None = None
    """Optimizer steps to run; when unset, `epochs` decides."""
    epochs: float = 1.0
    """Passes over the packed rows when `max_steps` is unset."""
    global_batch_size: int | None = None
    """Packed rows per optimizer step over all devices: what defines the run (structural). Unset:
    `micro_batch_size x grad_accum x devices` of the first start, kept when a resume has another device count."""
    micro_batch_size: int = 1
    """Rows per forward pass per device: a memory choice, free to change between restarts."""
    grad_accum: int | None = None
    """Micro-batches per optimizer step per device; derived from `global_batch_size` when unset (1 when both are)."""
    lr: float = 2e-4
    """Peak learning rate."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Learning-rate decay after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up steps from 0 to `lr`."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a share of `lr` for cosine and linear schedules."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay."""
    adam_beta2: float = 0.999
    """AdamW second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = "adamw"
    """`adamw` (fused on CUDA), or bitsandbytes 8-bit / paged 8-bit AdamW."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """Autocast for the trainable path; fp16 adds a gradient scaler."""
    max_bad_steps: int = 5
    """Stop after this many consecutive steps with a non-finite loss or gradient norm."""
    eval_every: int | None = None
    """Evaluate on the held-out split every N steps."""
    max_gpu_hours: float | None = None
    """Stop with a checkpoint once the whole run (all attempts) used this many device-hours."""
    max_cost: float | None = None
    """Stop with a checkpoint once the whole run cost this much (needs `metrics.price_per_hour`)."""
    distributed: Literal["ddp", "fsdp"] = "ddp"
    """Several processes: `ddp` keeps a whole model on every device; `fsdp` shards it (FSDP2, per decoder layer) for a base that does not fit one GPU. An `accelerate launch` FSDP config also selects fsdp. A checkpoint resumes under either."""
    fsdp_cpu_offload: bool = False
    """Under `fsdp`: keep the shards (and the optimizer step) in CPU memory, copied to the GPU a layer at a time; less GPU memory, slower steps."""


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int | None = None
    """Save every N optimizer steps."""
    every_minutes: float | None = 30.0
    """Save when this much wall time passed since the last save."""
    keep_last: int = 3
    """Committed checkpoints to keep (at least 2)."""
    resume: str = "auto"
    """`auto` (newest that verifies), `never`, or a checkpoint directory; `never` and a path set newer checkpoints aside."""
    allow_config_change: bool = False
    """Resume even if the dataset or a structural setting changed."""
    notice_seconds: float = 30.0
    """Preemption notice window: warn when a save takes longer; with checkpoint.remote, the time allowed to flush
    the last upload before exit."""
    preemption_notice: Literal["auto", "aws", "gcp", "azure", "off"] = "off"
    """Poll the cloud's spot notice (AWS/GCP/Azure metadata) and save-and-exit like SIGTERM; `auto` detects the
    provider. Off by default (no traffic to a metadata address off the cloud); the GPU recipes and launch templates
    turn it on."""
    notice_endpoint: str | None = None
    """Base URL of the metadata service for `preemption_notice` (default http://169.254.169.254)."""
    notice_poll_seconds: float = 5.0
    """Seconds between preemption-notice polls (AWS recommends 5)."""
    remote: str | None = None
    """fsspec URL (`s3://bucket/prefix`, `gs://`, `az://`, `file://`) that every checkpoint is uploaded to in the background; resume also looks there. Credentials come from the cloud's standard chain."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Extra fsspec options for `checkpoint.remote` (e.g. `{client_kwargs: {region_name: eu-west-1}}`); never credentials."""


@dataclass(frozen=True)
class MetricsConfig:
    log_every: int = 1
    """Write a metrics row every N optimizer steps."""
    warmup_steps: int = 2
    """Steps excluded from sustained throughput."""
    price_per_hour: float | None = None
    """Price of one device-hour, for the cost ledger."""
    gpu: str | None = None
    """GPU name for the peak FLOP/s table (detected when unset)."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device; overrides the table."""
    trackers: tuple[Literal["tensorboard", "wandb"], ...] = ()
    """Extra trackers through accelerate."""
    progress: bool = True
    """Show a progress bar on the console."""


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

    def __init__(self, problems: Sequence[str], source: str = "config") -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}")


# ---------------------------------------------------------------------------- loading


def load(recipe: str | Path | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a YAML recipe (or the defaults when None) and apply `key.sub=value` overrides."""
    source = str(recipe) if recipe is not None else "defaults"
    raw: dict[str, Any] = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError([f"recipe file not found: {path} (give the path to a YAML recipe)"], source)
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError([f"invalid YAML{where}: {getattr(e, 'problem', e)}"], source) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(["the recipe must be a YAML mapping of keys to values"], source)
        raw = loaded
    pairs: dict[str, Any] = {}
    problems: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"override {item!r} is not of the form key.sub=value")
            continue
        try:
            pairs[key.strip()] = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError:
            pairs[key.strip()] = value
    if problems:
        raise ConfigError(problems, "command line")
    return from_dict(_apply_overrides(raw, pairs, source="command line"), source=source)


def from_dict(raw: Mapping[str, Any], source: str = "config") -> RunConfig:
    """Build a RunConfig from nested plain data, collecting every problem before raising."""
    problems: list[str] = []
    cfg = build(RunConfig, raw, "", problems)
    problems.extend(cross_checks(cfg))  # fields that failed their type check hold valid defaults here
    if problems:
        raise ConfigError(problems, source)
    return cfg


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
    }


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
    """(dotted key, default, docstring) for every key, for the README reference and `spotune config`."""
    return config_rules.field_docs(RunConfig)
