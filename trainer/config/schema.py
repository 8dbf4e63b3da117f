"""The sections of a recipe: frozen typed dataclasses, one per top-level key, and their defaults.

Defaults are read here and nowhere else; each field's docstring is its documentation
(`spotune config --reference`, docs/config-reference.md). The numbers restart/ is tuned by are defined
beside the code they tune, with why (trainer/restart/defaults.py), and taken from there. `RunConfig`, which holds one of
each, and the loading live in `trainer/config/__init__.py`; the rules in `rules.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.restart import defaults as restart

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
    """torch.compile each decoder layer after peft wraps it; the first steps are slower while it compiles (the run's last words say how long; the ledger's `compile` phase and the forecast count it)."""
    compile_cache: bool = True
    """With `compile`: save what torch compiled with each checkpoint and load it in the next attempt when torch, Python, device kind, C library, compiler and model shape match, so a resumed run compiles in a fraction of the time (docs/compile.md); false: every attempt compiles from scratch. The saved folder is code (torch pickles its cache entries; kernels are shared libraries), trusted like whoever can write checkpoint.remote; the training state never reads it."""
    gradient_checkpointing: bool | Literal["auto"] = False
    """Recompute activations in backward (non-reentrant) to save memory; `auto`: only when the memory estimate says the run would not fit without it (trainer/training/autofit.py)."""
    activation_offload: Literal["off", "on", "auto"] = "off"
    """Move what the decoder saves for backward (with checkpointing: each layer's input) to host memory during the forward, back ahead of the backward (trainer/model/offload.py); `auto`: only when the estimate says the run would not fit otherwise."""
    tiled_mlp: Literal["off", "on", "auto"] = "off"
    """Compute each decoder layer's MLP and RMSNorms (the post-attention norm fused into the MLP's tiles), and the final norm, in sequence tiles of `tiled_mlp_tokens`, forward and backward (trainer/model/tiling.py), so their [tokens x intermediate] activations and fp32 copies never exist for the whole sequence: long sequences; `auto`: only when the memory estimate says the run would not fit otherwise."""
    tiled_mlp_tokens: int = 8192
    """Tokens per tile (MLP and norms) when `tiled_mlp` is on."""
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
    """Dropout on the LoRA input (SFT). The preference objectives (dpo, orpo, simpo, kto) train with every dropout off, this one and the model's own, as TRL's trainers do (`disable_dropout`): from `init_from`, step 1's policy is then exactly the reference."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Module names to adapt; `all-linear` adapts every linear layer but the output head."""
    train_router: bool = False
    """Mixture-of-experts models: also put LoRA on the routers (which experts each token goes to). Off, the routers stay as pretrained, which fine-tuning practice advises; the routed experts, shared experts and attention are adapted either way."""
    fused: bool = False
    """Compute the LoRA A matmuls of q/k/v, and of gate/up, as one wider matmul each (with dropout 0); checkpoints stay plain peft files."""
    init_from: str | None = None
    """Start the adapter from an earlier one instead of fresh: a run directory (its `final/`), one of its checkpoints or an adapter folder (adapter_config.json + adapter_model.safetensors), usually the SFT run before a DPO run; its shape must match adapter.r, alpha and target_modules, and it must have been trained on model.name_or_path at model.revision. With train.objective=dpo that adapter, frozen, is the reference. The first start copies it into the run directory (`init_adapter/`) and checkpoint.remote; every restart reads that copy, so a fresh machine need not reach the path."""


DataFormat = Literal["auto", "alpaca", "prompt_completion", "messages", "sharegpt", "text", "chat", "preference"]
"""The values of `data.format` and of each `data.sources[i].format`."""

CHAT_ROLES = ("system", "user", "assistant", "tool", "tool_call")
"""The roles a conversation's turns may take (what `data.sharegpt_roles` maps speakers to); `tool_call` is an assistant turn whose value is a call."""


@dataclass(frozen=True)
class SourceConfig:
    """One entry of `data.sources`: a source of its own, mixed with the others before packing."""

    path: str = ""
    """A local file or folder, or a hub dataset (`hf://datasets/org/name[@revision]` or `org/name`), as `data.path`."""
    subset: str | None = None
    """Hub dataset or folder: the config (subset) to read, as `data.subset`."""
    split: str = "train"
    """The split whose files are read, as `data.split`."""
    revision: str | None = None
    """Hub dataset: branch, tag or commit, pinned to a commit on the run's first start, as `data.revision`."""
    format: DataFormat | None = None
    """This source's data format (a value of `data.format`); unset: `data.format`."""
    fields: dict[str, str] = field(default_factory=dict)
    """Role -> column of this source (e.g. `{instruction: question, output: answer}`); unset roles: `data.*_field`."""
    rows: int | None = None
    """Take this many rows of the source (a seeded random choice; at most the rows it has)."""
    fraction: float | None = None
    """Take this share (0 < fraction <= 1) of the source's rows (a seeded random choice); unset with `rows`: all."""


@dataclass(frozen=True)
class DataConfig:
    path: str = BUILTIN_TINY_DATA
    """A JSONL, JSON array, Parquet or CSV file, a saved `datasets` folder, a folder of such files, or a hub dataset: `hf://datasets/org/name[@revision]` or `org/name` (when no such local path exists)."""
    subset: str | None = None
    """Hub dataset or folder: the config (subset) to read: the README's `configs:` entry of that name, else the files under `<subset>/`."""
    split: str = "train"
    """Hub dataset or folder: the split whose files are read (the README's `configs:`, else files named or foldered by split)."""
    revision: str | None = None
    """Hub dataset: branch, tag or commit. The run's first start pins the commit it resolved to (saved in the run's config.yaml, which travels with its checkpoints); every restart reads that commit."""
    sources: tuple[SourceConfig, ...] = ()
    """Several sources mixed into one training set instead of `path`: a list of {path, subset, split, revision, format, fields, rows or fraction}."""
    format: DataFormat = "auto"
    """`auto` (picked from the columns of the first rows, and said), `alpaca` (instruction/input/output, optional system), `prompt_completion` (TRL's prompt/completion, strings or message lists), `messages` (OpenAI role/content; `chat` is its former name), `sharegpt` (conversations of from/value), `text` (every token trained), `preference` (chosen/rejected pairs with or without a prompt column, for train.objective dpo/orpo/simpo; `auto` reads pairs whenever the objective is one of those); train.objective kto reads TRL's unpaired rows, `prompt`/`completion` with a bool `label` (`auto` or `prompt_completion`)."""
    seq_len: int = 2048
    """Tokens per packed row."""
    packing: bool = True
    """Best-fit-decreasing packing; false pads each example to `seq_len`."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """What to do with examples longer than `seq_len` (and, for preference pairs, with answers longer than `max_length`, `max_prompt_length` or `max_completion_length`)."""
    max_length: int | None = None
    """TRL's `max_length`. Preference objectives: the most tokens of EACH answer's sequence (prompt + answer), as TRL's DPOTrainer reads it; a longer one is cut by `truncation_mode` (or its pair dropped, `overlong: drop`), and `seq_len`, when not set, becomes 2 x max_length (a packed row holds one pair at its longest; `prepare` prints the sizing). SFT: the sequence length, read as `seq_len`."""
    max_prompt_length: int | None = None
    """Preference objectives: the most prompt tokens before each answer; a longer prompt keeps its end (TRL 0.x's `max_prompt_length`)."""
    max_completion_length: int | None = None
    """Preference objectives: the most tokens of each answer; a longer one keeps its start (TRL 0.x's `max_completion_length`)."""
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"
    """Preference objectives: how a sequence longer than `max_length` is cut, as in TRL: `keep_start` keeps its first tokens (a pair whose prompt alone fills `max_length` is dropped), `keep_end` its last (the prompt's start goes first)."""
    tokenizer: str | None = None
    """Tokenizer path or id; defaults to `model.name_or_path`."""
    tokenizer_revision: str | None = None
    """Hub revision (branch, tag or commit) of `data.tokenizer`; unset: `model.revision` when the tokenizer is the model's, so tokenizer, chat template and weights load at one commit."""
    chat_template: str | None = None
    """The chat template every conversational format is rendered with, and that `final/` and exports carry: unset is the tokenizer's own; `chatml`, `llama3`, `alpaca` (the Stanford prompt) name a built-in one for a base model without one; anything else is Jinja text."""
    template_date: str | None = None
    """The day (YYYY-MM-DD) a chat template that writes today's date (`strftime_now`, as Llama 3.2/3.3 do) writes into every row, so the same data renders alike on any day; unset: the day of the run's first start, kept in its config.yaml across restarts (today, for a prepare outside a run)."""
    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """Which assistant turns carry labels (with their end-of-turn token): every one, or only the conversation's last."""
    train_on_inputs: bool = False
    """Train every token (prompts, system and user turns too) but the first of each example."""
    instruction_field: str = "instruction"
    """Field holding the alpaca instruction."""
    input_field: str = "input"
    """Field holding the optional alpaca input (may be missing or empty), appended to the instruction after a blank line."""
    history_field: str = "history"
    """Field holding the earlier turns of an alpaca-form preference pair (LLaMA-Factory's `history`: a list of [query, response]), rendered before its instruction. Optional."""
    output_field: str = "output"
    """Field holding the alpaca response (trained)."""
    system_field: str = "system"
    """Field holding an optional system prompt (rendered as the system turn): alpaca's, a preference pair's, or the one beside `messages`/`sharegpt` turns (LLaMA-Factory's ShareGPT form; read when the turns hold no system turn)."""
    prompt_field: str = "prompt"
    """Field holding the prompt of `prompt_completion` and `preference` data (a string, or a list of messages; for pairs it may be absent: the turns chosen and rejected share)."""
    completion_field: str = "completion"
    """Field holding the completion of `prompt_completion` data (trained)."""
    chosen_field: str = "chosen"
    """Field holding the preferred answer of `preference` data (a string, a list of messages, or the whole conversation)."""
    rejected_field: str = "rejected"
    """Field holding the dispreferred answer of `preference` data (as `chosen_field`)."""
    messages_field: str = "messages"
    """Field holding `messages` data (`role`/`content`); only assistant turns are trained."""
    conversations_field: str = "conversations"
    """Field holding `sharegpt` data (turns of `from`/`value`)."""
    sharegpt_roles: dict[str, str] = field(default_factory=dict)
    """ShareGPT speaker -> role, added to the defaults human/user -> user, gpt/assistant -> assistant, system, tool/observation -> tool, function_call -> tool_call (an assistant turn whose value is a JSON call `{name, arguments}`); a turn with another speaker drops its row, counted as unknown_role."""
    tools_field: str = "tools"
    """Field holding a conversation's tools (function schemas, a list or its JSON text), for `messages`, `sharegpt` and `prompt_completion` rows and `preference` pairs that call functions; rendered by the chat template's tools header (never trained). Optional."""
    text_field: str = "text"
    """Field holding raw text for `text` format."""
    cache_dir: str | None = None
    """Where packed datasets are cached; defaults to `<output_dir>/data`."""
    num_proc: int = 1
    """Processes for tokenisation (`datasets.map`)."""
    eval_fraction: float = 0.0
    """Share of examples held out for evaluation (ignored when `eval_path` or `eval_split` is set)."""
    eval_path: str | None = None
    """A separate evaluation source (any `path` form), prepared like `path`."""
    eval_split: str | None = None
    """Evaluate on this split, e.g. `test`: of `eval_path` when set (else its `train`), otherwise of each training source at the same commit; instead of `eval_fraction`."""
    shuffle: bool = True
    """Shuffle rows each epoch (order is a pure function of seed and epoch)."""
    loader_workers: int | Literal["auto"] = "auto"
    """DataLoader worker processes that prefetch whole steps: `auto` is 1 on CUDA (reading and collating hide behind the GPU's work) and 0 on CPU (a worker would only compete for the cores). Same batches either way."""


@dataclass(frozen=True)
class TrainConfig:
    objective: Literal["sft", "dpo", "orpo", "simpo", "kto"] = "sft"
    """`sft`: next-token loss on the trained tokens. On chosen/rejected pairs (docs/preference.md): `dpo` against the run's starting point as reference (the base with adapters disabled, or adapter.init_from frozen), computed in the same step; `orpo` and `simpo` need no reference. `kto` (TRL's KTOTrainer) on unpaired answers: prompt/completion rows with a bool `label` (thumbs up or down), against the same reference as `dpo`."""
    beta: float = 0.1
    """Preference objectives: DPO's and KTO's beta (how far the policy may move from the reference; IPO's tau), ORPO's lambda, SimPO's beta (its paper uses 2 to 2.5)."""
    desirable_weight: float = 1.0
    """`kto`: the weight of each desirable (label true) answer's loss (TRL's `desirable_weight`). With unequal counts, KTO's paper wants desirable_weight x desirable / (undesirable_weight x undesirable) within 1 to 4/3; `prepare` prints the counts and says when that ratio is outside."""
    undesirable_weight: float = 1.0
    """`kto`: the weight of each undesirable (label false) answer's loss (TRL's `undesirable_weight`)."""
    dpo_loss: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"
    """`dpo`'s loss on the pair's reward margin, as TRL defines each: `sigmoid` (DPO), `ipo` (on per-token log-ratios), `hinge`, `robust` (with `label_smoothing`, the share of flipped labels)."""
    label_smoothing: float = 0.0
    """The share of pairs whose preference is taken to be flipped, in [0, 0.5): `dpo_loss: robust` and `simpo` only."""
    sft_weight: float = 0.0
    """`dpo` and `simpo`: add this times the chosen answers' next-token loss, averaged over their tokens in the optimizer step (TRL's `rpo_alpha` / `sft` loss, CPO's `cpo_alpha`); `orpo` always has it with weight 1."""
    simpo_gamma: float = 0.5
    """`simpo`: the target reward margin gamma (TRL's CPO default). SimPO's paper sets beta 2 to 2.5 and gamma/beta about 0.5 (Llama 3 Instruct: beta 2.5, gamma 1.375); a run outside beta 2 to 10 or gamma/beta 0.1 to 0.8 says so at its start."""
    max_steps: int | None = None
    """Optimizer steps to run; when unset, `epochs` decides."""
    epochs: float = 1.0
    """Passes over the packed rows when `max_steps` is unset."""
    global_batch_size: int | None = None
    """Packed rows per optimizer step over all devices: what defines the run (structural). Unset:
    `micro_batch_size x grad_accum x devices` of the first start, kept when a resume has another device count."""
    micro_batch_size: int | Literal["auto"] = 1
    """Rows per forward pass per device: a memory choice, free to change between restarts. `auto`: the largest that the memory estimate fits on this device (needs `global_batch_size`; accumulation absorbs it)."""
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
    mixed_precision: Literal["no", "bf16", "fp16", "auto"] = "no"
    """Autocast for the trainable path; fp16 adds a gradient scaler; `auto` (Axolotl's `bf16: auto`): bf16 on a GPU that has it (Ampere or newer), else no, decided by each process at its start."""
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
    deterministic: bool = False
    """Deterministic kernels only, so that on a GPU two runs, and a stopped-and-resumed run, end bit-identical (on CPU in fp32 they already are). Costs GPU speed (docs/gpu.md, Determinism); refuses model.compile."""
    fsdp_cpu_offload: bool = False
    """Under `fsdp`: keep the shards (and the optimizer step) in CPU memory, copied to the GPU a layer at a time; less GPU memory, slower steps."""
    collective_timeout_seconds: float | None = 300.0
    """Several processes: once the first step is done, a collective that waits this long for another rank (one that hung, or died unseen by NCCL) ends the run, so a supervisor restarts it from the last checkpoint. Start-up and the end of the run keep torch's default (10 min NCCL, 30 min gloo); null keeps it throughout."""
    router_aux_loss_coef: float = 0.001
    """Mixture-of-experts models: weight of the routers' load-balancing loss (the family's own, Switch Transformer's) added to the objective's loss, SFT or preference, and reduced over the optimizer step like it; reported as `router_aux_loss`. 0: none. Families that balance without one (DeepSeek-V3, GLM-4-MoE) and dense models ignore it."""


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int | None = None
    """Save every N optimizer steps."""
    every_minutes: float | None = restart.SAVE_EVERY_MINUTES
    """Save when this much wall time passed since the last save."""
    keep_last: int = restart.KEEP_LAST
    """Committed checkpoints to keep (at least 2)."""
    resume: str = "auto"
    """`auto` (newest that verifies), `never`, or a checkpoint directory; `never` and a path set newer checkpoints aside."""
    allow_config_change: bool = False
    """Resume even if the dataset or a structural setting changed."""
    notice_seconds: float = restart.NOTICE_SECONDS
    """Preemption notice window: warn when a save takes longer; with checkpoint.remote, the time allowed to flush
    the last upload before exit."""
    preemption_notice: Literal["auto", "aws", "gcp", "azure", "off"] = "off"
    """Poll the cloud's spot notice (AWS/GCP/Azure metadata) and save-and-exit like SIGTERM; `auto` detects the
    provider. Off by default (no traffic to a metadata address off the cloud); the GPU recipes and launch templates
    turn it on."""
    notice_endpoint: str | None = None
    """Base URL of the metadata service for `preemption_notice` (default http://169.254.169.254)."""
    notice_poll_seconds: float = restart.NOTICE_POLL_SECONDS
    """Seconds between preemption-notice polls (AWS recommends 5)."""
    remote: str | None = None
    """fsspec URL (`s3://bucket/prefix`, `gs://`, `az://`, `file://`) that every checkpoint is uploaded to in the background; resume also looks there. Credentials come from the cloud's standard chain."""
    lease_seconds: float = restart.LEASE_SECONDS
    """With `checkpoint.remote`: how long the run's lease lasts unrenewed (renewed every third of it). A replacement
    machine takes over a silent holder's run after this; the holder stops writing a little before."""
    store_outage_seconds: float = restart.STORE_OUTAGE_SECONDS
    """With `checkpoint.remote`: how long training goes on with local checkpoints while the store cannot be reached
    (nothing is written there meanwhile); past it the run saves locally and exits 143, which supervisors restart."""
    store_retry_seconds: float = restart.STORE_RETRY_SECONDS
    """With `checkpoint.remote`: how long a start waits out a store that fails for a reason of the moment (the
    network, 5xx, throttling, a broken transfer), retrying with backoff, before it exits 143 without training; it
    never trains from an older checkpoint than the store's newest instead. At most `store_outage_seconds`."""
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
    trackers: tuple[Literal["tensorboard", "wandb", "mlflow"], ...] = ()
    """Experiment trackers; every attempt of the run continues the same tracker run (docs/trackers-and-logs.md)."""
    project: str | None = None
    """The W&B project / MLflow experiment the run is logged under; unset: the tracker's own setting (`WANDB_PROJECT`, `MLFLOW_EXPERIMENT_NAME`), else `spotune`."""
    run_name: str | None = None
    """The tracker run's display name (default: the output directory's name)."""
    tags: tuple[str, ...] = ()
    """Tags of the tracker run (W&B tags; MLflow tags set to "true")."""
    progress: bool = True
    """A progress bar when stderr is a terminal; false, or no terminal: one plain line per log step."""
    report: bool = True
    """Write report.html and its charts into the run directory as each attempt ends (a few seconds of CPU for
    matplotlib); false: none, `spotune report RUN_DIR` writes it from the same files at any time."""
