"""Keys people already know: the Hugging Face Trainer / TRL / Axolotl names, read as spotune's
own where the meaning is the same, and answered with spotune's key and the conversion where it
is not. One table, `ALIASES` and `ANSWERS`; scripts/config_reference.py renders both into
docs/config-reference.md, and docs/config.md lists every name (tests keep both in sync).

A known name is accepted in any section or at the top level (`learning_rate: 2e-4`,
`train.learning_rate=2e-4`, `adapter.lora_r: 8`), as is a spotune key written in the wrong
section when its name belongs to one section only (`lr: 1e-4` is `train.lr`). A value is read as
the other tool reads it wherever its name is written (`optimizer: adamw_torch` and
`train.optimizer: adamw_torch`; HF's `max_steps: -1`, "no limit"), and HF's pair of flags means
what it means there: `bf16: true` with `fp16: false` is bf16 (a false flag says only "not this one",
and gives way to the other), `bf16: auto` (Axolotl) is bf16 where the GPU has it. Each rewrite is
noted in the log once per process.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainer.config.source import Mark, Marks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Alias:
    """Another name for a spotune key, with the same meaning (and, for a few, other spellings of its values)."""

    key: str
    values: Mapping[Any, Any] | None = None
    """The other tool's value -> spotune's; a value not listed passes unchanged to the type check."""
    gives_way: tuple[Any, ...] = ()
    """Mapped values that say only what is not wanted (`bf16: false`): another name setting the key wins,
    unless it sets what this flag's `true` means."""
    implies: Mapping[Any, Mapping[str, Any]] | None = None
    """The other tool's value -> further spotune keys it sets (Axolotl's `rl: ipo` is train.objective=dpo and
    train.dpo_loss=ipo). An implied key wins over one set through another tool's name (LLaMA-Factory's
    `stage: dpo` with `pref_loss: orpo` is ORPO) and must agree with one written as spotune's own key."""
    defaults: Mapping[Any, Mapping[str, Any]] | None = None
    """The other tool's value -> further spotune keys it sets unless they are set (by any name): the other
    tool's default that spotune's lacks (TRL's CPO `loss_type: simpo` keeps its cpo_alpha=1.0 SFT term)."""
    lists: str | None = None
    """The answer to a list value not in `values`, for a name the other tool also takes a list of (TRL 1.x's
    `loss_type: [sigmoid, sft]`); lists in `values` are keyed as their sorted tuple."""


_TO_OBJECTIVE = {"orpo": {"train.objective": "orpo"}, "simpo": {"train.objective": "simpo"}}
"""A preference loss that is an objective of its own in spotune (LLaMA-Factory's and TRL's CPO `simpo`)."""
_CPO_ALPHA = {"train.sft_weight": 1.0}
"""TRL's CPOConfig default cpo_alpha, kept by `loss_type: simpo` there and by Axolotl's `rl: simpo` (which passes
it on); LLaMA-Factory's `pref_loss: simpo` has no such term. TRL 1.x's `[sigmoid, sft]` weighs both 1."""
_SIGMOID_SFT = ("sft", "sigmoid")

_ADAMW = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw_bnb_8bit": "adamw_8bit"}

ALIASES: dict[str, Alias] = {
    "learning_rate": Alias("train.lr"),
    "num_epochs": Alias("train.epochs"),
    "num_train_epochs": Alias("train.epochs"),
    "max_steps": Alias("train.max_steps", {-1: None}),  # HF's "no limit": the epochs decide
    "warmup_steps": Alias("train.warmup_steps"),
    "micro_batch_size": Alias("train.micro_batch_size"),
    "global_batch_size": Alias("train.global_batch_size"),
    "weight_decay": Alias("train.weight_decay"),
    "max_grad_norm": Alias("train.max_grad_norm"),
    "adam_beta1": Alias("train.adam_beta1"),
    "adam_beta2": Alias("train.adam_beta2"),
    "adam_epsilon": Alias("train.adam_eps"),
    "lr_scheduler_type": Alias("train.schedule", {"constant_with_warmup": "constant"}),
    "lr_scheduler": Alias("train.schedule", {"constant_with_warmup": "constant"}),
    "optim": Alias("train.optimizer", _ADAMW),
    "optimizer": Alias("train.optimizer", _ADAMW),
    "bf16": Alias("train.mixed_precision", {True: "bf16", False: "no", "auto": "auto"}, gives_way=("no",)),
    "fp16": Alias("train.mixed_precision", {True: "fp16", False: "no", "auto": "auto"}, gives_way=("no",)),
    "eval_steps": Alias("train.eval_every"),
    "lora_r": Alias("adapter.r"),
    "lora_alpha": Alias("adapter.alpha"),
    "lora_dropout": Alias("adapter.dropout"),
    "lora_target_modules": Alias("adapter.target_modules"),
    "sequence_len": Alias("data.seq_len"),
    "max_seq_length": Alias("data.seq_len"),
    "max_seq_len": Alias("data.seq_len"),
    "max_length": Alias("data.max_length"),  # SFT: data.seq_len; preference: per answer, as TRL (config/__init__.py)
    "cutoff_len": Alias("data.seq_len"),
    "sample_packing": Alias("data.packing"),
    "dataset_text_field": Alias("data.text_field"),
    "dataloader_num_workers": Alias("data.loader_workers"),
    "train_on_inputs": Alias("data.train_on_inputs"),
    "base_model": Alias("model.name_or_path"),
    "model_name_or_path": Alias("model.name_or_path"),
    "model_revision": Alias("model.revision"),
    "torch_dtype": Alias("model.dtype"),
    "gradient_checkpointing": Alias("model.gradient_checkpointing"),
    "logging_steps": Alias("metrics.log_every"),
    "report_to": Alias("metrics.trackers", {"none": [], "all": ["tensorboard", "wandb"]}),
    "output_dir": Alias("output_dir"),
    "seed": Alias("seed"),
    "rl": Alias(
        "train.objective", {"ipo": "dpo"}, implies={"ipo": {"train.dpo_loss": "ipo"}}, defaults={"simpo": _CPO_ALPHA}
    ),
    "rl_beta": Alias("train.beta"),
    "orpo_alpha": Alias("train.beta"),
    "dpo_label_smoothing": Alias("train.label_smoothing"),
    "stage": Alias("train.objective"),
    "pref_beta": Alias("train.beta"),
    "pref_loss": Alias("train.dpo_loss", {"orpo": "sigmoid", "simpo": "sigmoid"}, implies=_TO_OBJECTIVE),
    "loss_type": Alias(
        "train.dpo_loss",
        {"simpo": "sigmoid", _SIGMOID_SFT: "sigmoid", "kto": "sigmoid"},
        implies={"simpo": _TO_OBJECTIVE["simpo"], "kto": {"train.objective": "kto"}},  # KTOConfig's default loss
        defaults={"simpo": _CPO_ALPHA, _SIGMOID_SFT: _CPO_ALPHA},
        lists="spotune trains one preference loss (train.dpo_loss), plus train.sft_weight times the chosen answers' "
        "next-token loss: a list is read only as [sigmoid, sft] (train.dpo_loss=sigmoid train.sft_weight=1.0); "
        "set train.dpo_loss and train.sft_weight",
    ),
    "kto_desirable_weight": Alias("train.desirable_weight"),  # Axolotl
    "kto_undesirable_weight": Alias("train.undesirable_weight"),  # Axolotl
    "kto_chosen_weight": Alias("train.desirable_weight"),  # LLaMA-Factory
    "kto_rejected_weight": Alias("train.undesirable_weight"),  # LLaMA-Factory
    "rpo_alpha": Alias("train.sft_weight"),
    "cpo_alpha": Alias("train.sft_weight"),
    "router_aux_loss_coef": Alias("train.router_aux_loss_coef"),  # TRL, transformers' MoE configs
    "moe_aux_loss_coef": Alias("train.router_aux_loss_coef"),  # LLaMA-Factory
}
"""Same meaning as the spotune key: read as it."""

ANSWERS: dict[str, str] = {
    "gradient_accumulation_steps": "spotune fixes the rows per optimizer step over all GPUs, train.global_batch_size "
    "(= per-device batch x accumulation x GPUs), and derives the accumulation from it on whatever GPUs a restart "
    "gets; set train.global_batch_size=<micro-batch x {value} x GPUs>, or train.grad_accum={value} to pin the "
    "per-device count",
    "per_device_train_batch_size": "spotune's per-device forward is train.micro_batch_size, in packed rows of "
    "data.seq_len tokens (`auto` picks the largest that fits the GPU), and the run is defined by "
    "train.global_batch_size (= per-device batch x accumulation x GPUs); set train.micro_batch_size={value} (or auto) "
    "and train.global_batch_size",
    "warmup_ratio": "spotune warms up for a number of optimizer steps; set train.warmup_steps = {value} x the run's "
    "steps (`spotune estimate RECIPE` prints the steps under `run`)",
    "save_steps": "spotune saves every checkpoint.every_steps optimizer steps and also every checkpoint.every_minutes "
    "(30 by default: the spot-safe timer); for steps alone set checkpoint.every_steps={value} "
    "checkpoint.every_minutes=null",
    "save_strategy": "spotune saves by checkpoint.every_steps and checkpoint.every_minutes (whichever is due first); "
    "set one or both",
    "save_total_limit": "set checkpoint.keep_last={value} (at least 2, so that a committed checkpoint always survives)",
    "resume_from_checkpoint": "checkpoint.resume: `auto` (the default) resumes from the newest checkpoint that "
    "verifies, a directory resumes from it, `never` starts over",
    "load_in_4bit": "set adapter.method=qlora adapter.quant_bits=4 (NF4 with double quantisation)",
    "load_in_8bit": "set adapter.method=qlora adapter.quant_bits=8 (LLM.int8)",
    "adapter": "adapter is a section in spotune: write adapter.method: {value}",
    "lora_target_linear": "set adapter.target_modules=[all-linear] (the default: every linear layer but the head)",
    "roles_to_train": "spotune trains assistant turns (and their end-of-turn token) only; "
    "data.train_on=last_assistant trains the last one, data.train_on_inputs=true every token",
    "datasets": "data.path for one source (a file, a folder or a hub id), or data.sources: a list of "
    "entries (path, format, fields, rows or fraction) mixed into one training set",
    "dataset": "data.path for one source (a file, a folder or a hub id), or data.sources: a list of "
    "entries (path, format, fields, rows or fraction) mixed into one training set",
    "val_set_size": "set data.eval_fraction (a share below 1) or data.eval_path (a separate file)",
    "flash_attention": "set model.attn_implementation=flash_attention_2 (`auto`, the default, picks "
    "flash_attention_3/2 on CUDA when installed)",
    "deepspeed": "spotune shards with train.distributed=fsdp (FSDP2, per decoder layer); no DeepSpeed config",
    "fsdp": "set train.distributed=fsdp (FSDP2, per decoder layer), and train.fsdp_cpu_offload=true to keep the "
    "shards in CPU memory",
    "pref_ftx": "spotune's SFT term is TRL's: train.sft_weight={value} weighs the chosen answers' next-token loss "
    "averaged over all their tokens in the step; LLaMA-Factory's pref_ftx averages it per pair first, which weighs "
    "short answers more. Set train.sft_weight={value} for the TRL form",
    "ref_model": "the DPO reference is the run's starting point, in the same model: the base with adapters "
    "disabled, or adapter.init_from (an earlier run or adapter folder) frozen; set adapter.init_from to start from "
    "the SFT adapter",
    "precompute_ref_log_probs": "spotune computes the DPO reference in the same step, never beforehand: with LoRA "
    "it is one forward without a backward (about a third of the step), it needs no pass over the data before "
    "training nor a file to carry to a fresh machine, and it can never be stale; remove it",
    "loss_weights": "spotune trains one preference loss plus train.sft_weight x the chosen answers' next-token loss: "
    "for loss_type [sigmoid, sft] with loss_weights [a, b] set train.sft_weight=b/a (AdamW's steps do not depend on "
    "the overall scale a); other mixes of losses are not trained, remove it",
    "sync_ref_model": "spotune's DPO and KTO reference is the run's starting point, fixed for the whole run (a "
    "restart recomputes it from the same weights, which keeps resumes exact); TR-DPO's moving reference is not "
    "trained; remove it (and ref_model_mixup_alpha, ref_model_sync_steps)",
    "ref_model_mixup_alpha": "spotune's reference is fixed (see sync_ref_model); remove it",
    "ref_model_sync_steps": "spotune's reference is fixed (see sync_ref_model); remove it",
    "precompute_ref_batch_size": "spotune computes the reference in the same step, never beforehand "
    "(see precompute_ref_log_probs); remove it",
    "train_sampling_strategy": "spotune's row order is its sampler's (data.shuffle, a pure function of the seed and "
    "epoch); KTO's mismatched completions are fixed when the data is prepared (each prompt with the previous "
    "row's completion of the same source), so the order cannot break them; remove it",
    "generate_during_eval": "spotune's evaluation logs eval_loss and the rewards and reward accuracy of the "
    "held-out pairs without generating; sample the model's answers after training with `spotune chat RUN_DIR`; "
    "remove it",
}
"""Known names whose meaning differs from every spotune key: the key(s) to set and how to convert."""

_noted: set[str] = set()


def resolve(
    pairs: Mapping[str, Any], marks: Marks, fields: Mapping[str, frozenset[str]]
) -> tuple[dict[str, Any], Marks, list[str]]:
    """Dotted pairs with every known name read as the spotune key: (pairs, marks, problems, each
    already prefixed with where its key was set).

    `fields` maps "" to the top-level keys and each section to its keys. Two names for one key
    in the same source is a problem (which would win is not obvious); a later source (the
    command line) overriding an earlier one is not, and is the caller's merge.
    """
    out: dict[str, Any] = {}
    out_marks: Marks = dict(marks)
    problems: list[str] = []
    origin: dict[str, str] = {}
    implied: list[tuple[str, str, Any]] = []  # (name, key, value)
    defaults: list[tuple[str, str, Any]] = []  # the same, where the key is not set
    for dotted, value in pairs.items():
        target, value, problem = _target(dotted, value, fields)
        if target in out and problem is None:
            if value == out[target] or _gives_way(dotted, value, out[target]):
                continue  # the same setting twice, or `fp16: false` beside `bf16: true`
            if not _gives_way(origin[target], out[target], value):
                problem = f"{dotted}: {target} is also set by {origin[target]}; keep one of them"
        if problem is not None:
            problems.append(f"{marks[dotted].where}: {problem}" if dotted in marks else problem)
            continue
        out[target], origin[target] = value, dotted
        if target != dotted:
            _note(dotted, target, marks.get(dotted))
            if dotted in marks:
                out_marks[target] = Mark(marks[dotted].where, marks[dotted].text if value == pairs[dotted] else None)
            alias = ALIASES.get(dotted.rpartition(".")[2])
            written = _key(pairs[dotted])
            if alias is not None and _hashable(written):
                implied += [(dotted, k, v) for k, v in (alias.implies or {}).get(written, {}).items()]
                defaults += [(dotted, k, v) for k, v in (alias.defaults or {}).get(written, {}).items()]
    for name, key, value in implied:
        if key in out and origin[key] == key and out[key] != value:
            problem = (
                f"{name}: {pairs[name]!r} means {key}={value!r}, but {key} is set to {out[key]!r}; keep one of them"
            )
            problems.append(f"{marks[name].where}: {problem}" if name in marks else problem)
            continue
        out[key], origin[key] = value, name
        _note(f"{name}={pairs[name]}", f"{key}={value}", marks.get(name))
        if name in marks:
            out_marks[key] = Mark(marks[name].where, None)
    for name, key, value in defaults:
        if key not in out:
            out[key], origin[key] = value, name
            _note(f"{name}={pairs[name]}", f"{key}={value}", marks.get(name))
            if name in marks:
                out_marks[key] = Mark(marks[name].where, None)
    return out, out_marks, problems


def _target(dotted: str, value: Any, fields: Mapping[str, frozenset[str]]) -> tuple[str, Any, str | None]:
    """(spotune key, value, None), or (dotted, value, the answer) for a name whose meaning differs."""
    section, _, leaf = dotted.rpartition(".")
    if not section and dotted in fields[""]:
        if dotted in fields and dotted in ANSWERS and isinstance(value, str):  # Axolotl's `adapter: qlora`
            return dotted, value, f"{dotted}: {ANSWERS[dotted].format(value=value)}"
        return dotted, value, None
    if "." in section or (section and section not in fields):
        return dotted, value, None  # deeper keys and unknown sections: the schema's check
    alias = ALIASES.get(leaf)
    if leaf in fields.get(section, ()):  # a real key, its value perhaps as another tool writes it
        same = alias is not None and alias.key == dotted  # `train.optimizer: adamw_torch`
        return dotted, _mapped(alias, value) if same and alias is not None else value, None
    if alias is not None:
        if alias.lists and isinstance(value, list) and _key(value) not in (alias.values or {}):
            return dotted, value, f"{dotted}: {alias.lists}"
        return alias.key, _mapped(alias, value), None
    if leaf in ANSWERS:
        return dotted, value, f"{dotted}: {ANSWERS[leaf].format(value=value)}"
    owners = [s for s, keys in fields.items() if s and leaf in keys]
    if len(owners) == 1:  # a spotune key in another section, or at the top level: `lr: 1e-4`
        return f"{owners[0]}.{leaf}", value, None
    return dotted, value, None


def _mapped(alias: Alias, value: Any) -> Any:
    key = _key(value)
    return alias.values.get(key, value) if alias.values and _hashable(key) else value


def _key(value: Any) -> Any:
    """`value` as the tables key it: a list as its sorted tuple (TRL 1.x's `loss_type: [sigmoid, sft]`)."""
    return tuple(sorted(map(str, value))) if isinstance(value, list) else value


def _gives_way(name: str, value: Any, other: Any) -> bool:
    """Whether `name: value` only says what is not wanted (`bf16: false`), so `other` wins, unless
    `other` is what it refuses (`bf16: false` beside `mixed_precision: bf16`)."""
    alias = ALIASES.get(name.rpartition(".")[2])
    if alias is None or not _hashable(value) or value not in alias.gives_way:
        return False
    return other != _mapped(alias, True)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _note(name: str, key: str, mark: Mark | None) -> None:
    if name in _noted:
        return
    _noted.add(name)
    where = f" ({mark.where})" if mark else ""
    log.warning("config: %s%s read as %s", name, where, key)
