"""What `spotune estimate` is asked about, as plain records: the job, what a pilot measured,
the command line's constraints, and the run's totals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.config import AdapterConfig, CheckpointConfig, ModelConfig, TrainConfig, dropout_off, runs_reference
from trainer.model import flops
from trainer.plan import memory as mem


@dataclass(frozen=True)
class Job:
    """What is trained, in the terms the estimate needs: the model's shape and the recipe's sections."""

    name_or_path: str
    shape: flops.ModelShape
    hf_model_type: str
    model: ModelConfig
    adapter: AdapterConfig
    train: TrainConfig
    checkpoint: CheckpointConfig
    seq_len: int
    price_per_hour: float | None = None
    """`metrics.price_per_hour`: the price of a device that is not in the catalogue."""

    @property
    def weight_format(self) -> mem.WeightFormat:
        if self.adapter.method == "qlora":
            return "nf4" if self.adapter.quant_bits == 4 else "int8"
        return self.model.dtype

    @property
    def lora_params(self) -> int:
        return flops.lora_params(self.shape, self.adapter.r, self.adapter.target_modules)

    @property
    def fsdp(self) -> bool:
        return self.train.distributed == "fsdp"

    def memory(self, devices: int = 1, fsdp: bool | None = None) -> mem.MemoryEstimate:
        """Peak bytes per device on `devices` GPUs: sharded under FSDP (`fsdp`, default the
        recipe's `train.distributed`), a whole copy on each under DDP. An `auto` memory setting
        counts as its most frugal choice (micro-batch 1, checkpointing, offloading and MLP tiling on): whether
        the run fits at all (trainer/training/autofit.py picks the fastest that fits on the device)."""
        sharded = self.fsdp if fsdp is None else fsdp
        estimate = mem.estimate_memory(
            self.shape,
            weight_format=self.weight_format,
            compute_dtype=self.model.dtype,
            lora_params=self.lora_params,
            lora_r=self.adapter.r,
            target_modules=self.adapter.target_modules,
            lora_dropout=self.adapter.dropout > 0 and not dropout_off(self.train),
            optimizer=self.train.optimizer,
            micro_batch_size=micro if isinstance(micro := self.train.micro_batch_size, int) else 1,
            seq_len=self.seq_len,
            gradient_checkpointing=ckpt if isinstance(ckpt := self.model.gradient_checkpointing, bool) else True,
            activation_offload=self.model.activation_offload != "off",
            eager_attention=self.model.attn_implementation == "eager",
            shards=devices if sharded else 1,
            offload=sharded and self.train.fsdp_cpu_offload,
            tiled_mlp=self.model.tiled_mlp != "off",
            mlp_tile_tokens=self.model.tiled_mlp_tokens,
            attention_output_copy=self.model.attn_implementation not in ("flash_attention_2", "flash_attention_3"),
        )
        reference = runs_reference(self.train.objective) and self.adapter.init_from is not None
        return mem.with_reference_adapter(estimate) if reference else estimate

    @property
    def shardable(self) -> bool:
        """Whether FSDP can train it: not QLoRA on a mixture of experts, whose NF4 experts are no parameters FSDP
        shards (trainer/model/load.py refuses it)."""
        return not (self.adapter.method == "qlora" and self.shape.experts > 0)

    def fsdp_devices(self, memory_gib: float) -> int | None:
        """The fewest devices of `memory_gib` each that hold the run under FSDP (None: over 64, or not shardable)."""
        if not self.shardable:
            return None
        return mem.smallest_shard_count(lambda n: self.memory(n, fsdp=True).total <= memory_gib * mem.GIB)


@dataclass(frozen=True)
class Measured:
    """What a pilot measured besides throughput (pilot.json, trainer/plan/pilot.py); None: no pilot."""

    pilot: dict[str, Any] | None = None

    def get(self, key: str) -> Any:
        return (self.pilot or {}).get(key)

    @property
    def fixed_sd(self) -> float:
        """Standard deviation of one process's fixed costs between the pilot's processes."""
        return float((self.get("fixed") or {}).get("sd") or 0.0)


@dataclass(frozen=True)
class Constraints:
    """The command line's choices: GPU count, one GPU only, a deadline or a budget."""

    gpus: int = 1
    gpu: str | None = None
    deadline_hours: float | None = None
    budget: float | None = None


@dataclass(frozen=True)
class Totals:
    """The whole run: steps, tokens and FLOPs (from the workload and the batch)."""

    steps: int
    global_rows: int
    tokens: float
    trainable: float
    doc_sq: float
    train_flops: float

    @property
    def flops_per_token(self) -> float:
        return self.train_flops / self.tokens if self.tokens else 0.0
