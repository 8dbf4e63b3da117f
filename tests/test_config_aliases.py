"""Keys people know from Hugging Face / TRL / Axolotl, values typed as on/off, and the file:line of
every config problem."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from trainer import config as C
from trainer.config import aliases
from trainer.config.aliases import ALIASES, ANSWERS

# A value for each key aliases lead to, as typed and as read; none is the default (so a name read
# as the wrong key, or dropped, fails).
SAMPLE: dict[str, tuple[str, Any]] = {
    "adapter.alpha": ("8", 8.0),
    "adapter.dropout": ("0.1", 0.1),
    "adapter.r": ("8", 8),
    "adapter.target_modules": ("[q_proj, v_proj]", ("q_proj", "v_proj")),
    "data.loader_workers": ("3", 3),
    "data.packing": ("false", False),
    "data.train_on_inputs": ("true", True),
    "data.seq_len": ("1024", 1024),
    "data.max_length": ("512", 512),
    "data.text_field": ("body", "body"),
    "metrics.log_every": ("7", 7),
    "metrics.trackers": ("[wandb]", ("wandb",)),
    "model.dtype": ("float16", "float16"),
    "model.gradient_checkpointing": ("true", True),
    "model.name_or_path": ("org/model", "org/model"),
    "model.revision": ("v2", "v2"),
    "output_dir": ("runs/other", "runs/other"),
    "seed": ("7", 7),
    "train.adam_beta1": ("0.8", 0.8),
    "train.adam_beta2": ("0.95", 0.95),
    "train.adam_eps": ("1e-6", 1e-6),
    "train.epochs": ("3", 3.0),
    "train.eval_every": ("50", 50),
    "train.global_batch_size": ("32", 32),
    "train.lr": ("3e-4", 3e-4),
    "train.max_grad_norm": ("0.5", 0.5),
    "train.max_steps": ("9", 9),
    "train.micro_batch_size": ("2", 2),
    "train.mixed_precision": ("bf16", "bf16"),
    "train.optimizer": ("adamw_8bit", "adamw_8bit"),
    "train.schedule": ("linear", "linear"),
    "train.warmup_steps": ("12", 12),
    "train.weight_decay": ("0.01", 0.01),
    "train.objective": ("dpo", "dpo"),
    "train.beta": ("0.2", 0.2),
    "train.label_smoothing": ("0.1", 0.1),
    "train.dpo_loss": ("hinge", "hinge"),
    "train.sft_weight": ("0.5", 0.5),
    "train.desirable_weight": ("1.5", 1.5),
    "train.undesirable_weight": ("0.5", 0.5),
    "train.router_aux_loss_coef": ("0.02", 0.02),
}
TRANSLATED = {"bf16": ("true", "bf16"), "fp16": ("true", "fp16")}  # bool flags -> the spotune choice


def _get(cfg: C.RunConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def test_every_alias_target_has_a_sample() -> None:
    assert {a.key for a in ALIASES.values()} == set(SAMPLE)
    for key, (_, value) in SAMPLE.items():
        assert _get(C.load(None), key) != value, f"{key}: the sample is the default"


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_each_alias_reads_exactly_as_its_key(name: str, tmp_path: Path) -> None:
    key = ALIASES[name].key
    text, expected = TRANSLATED.get(name, SAMPLE[key])
    if name == "fp16":  # fp16 autocast over a bf16 base is refused; the recipe would say float16
        extra = ["model.dtype=float16"]
    elif name == "max_length":  # a preference objective keeps it as each answer's cap (SFT: data.seq_len)
        extra = ["train.objective=dpo"]
    elif key in ("train.desirable_weight", "train.undesirable_weight"):  # read by kto alone
        extra = ["train.objective=kto"]
    else:
        extra = []
    own = C.load(None, [f"{key}={expected if name in TRANSLATED else text}", *extra])
    assert _get(own, key) == expected  # control: the spotune key itself
    section = "model" if not key.startswith("model.") else "train"  # any section, even another one
    for written in (name, f"{section}.{name}"):
        assert C.load(None, [f"{written}={text}", *extra]) == own, written
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"{name}: {text}\n")
    assert C.load(recipe, extra) == own


def test_other_spellings_of_values() -> None:
    cfg = C.load(None, ["optim=adamw_torch_fused", "lr_scheduler_type=constant_with_warmup", "report_to=none"])
    assert (cfg.train.optimizer, cfg.train.schedule, cfg.metrics.trackers) == ("adamw", "constant", ())
    cfg = C.load(None, ["optimizer=adamw_bnb_8bit", "bf16=false", "report_to=[tensorboard]"])
    assert (cfg.train.optimizer, cfg.train.mixed_precision, cfg.metrics.trackers) == (
        "adamw_8bit",
        "no",
        ("tensorboard",),
    )
    with pytest.raises(C.ConfigError, match=r"override optim=sgd: train.optimizer: expected one of 'adamw'"):
        C.load(None, ["optim=sgd"])  # a value not listed reaches the type check, named by the spotune key


def test_a_spotune_key_in_another_section_or_at_the_top() -> None:
    cfg = C.load(None, ["lr=1e-3", "model.micro_batch_size=3", "target_modules=[q_proj]", "data.warmup_steps=4"])
    assert (cfg.train.lr, cfg.train.micro_batch_size, cfg.adapter.target_modules) == (1e-3, 3, ("q_proj",))
    assert (cfg.train.warmup_steps, cfg.metrics.warmup_steps) == (4, 2)  # `warmup_steps` is train's (the table)
    assert C.load(None, ["metrics.warmup_steps=4"]).metrics.warmup_steps == 4  # a real key stays where it is


ANSWER_CHECKS = {
    "gradient_accumulation_steps": ["train.global_batch_size=<micro-batch x 4 x GPUs>", "train.grad_accum=4"],
    "per_device_train_batch_size": ["train.micro_batch_size=4 (or auto)", "train.global_batch_size"],
    "warmup_ratio": ["train.warmup_steps = 4 x the run's steps"],
    "save_steps": ["checkpoint.every_steps=4 checkpoint.every_minutes=null"],
    "save_total_limit": ["checkpoint.keep_last=4"],
    "load_in_4bit": ["adapter.method=qlora adapter.quant_bits=4"],
    "load_in_8bit": ["adapter.method=qlora adapter.quant_bits=8"],
    "val_set_size": ["data.eval_fraction", "data.eval_path"],
    "datasets": ["data.path", "data.sources"],
    "roles_to_train": ["data.train_on=last_assistant", "data.train_on_inputs=true"],
    "fsdp": ["train.distributed=fsdp"],
    "precompute_ref_log_probs": ["in the same step", "remove it"],
    "loss_weights": ["train.sft_weight=b/a"],
    "generate_during_eval": ["spotune chat RUN_DIR", "remove it"],
}


@pytest.mark.parametrize("name", sorted(set(ANSWERS) - {"adapter"}))
def test_each_differing_name_is_answered_with_the_spotune_key(name: str) -> None:
    with pytest.raises(C.ConfigError) as err:
        C.load(None, [f"train.{name}=4"])
    (problem,) = err.value.problems
    assert problem.startswith(f"override train.{name}=4: train.{name}: ")
    assert problem.endswith(ANSWERS[name].format(value=4))
    for fix in ANSWER_CHECKS.get(name, []):
        assert fix in problem, (name, problem)
    assert "did you mean" not in problem and "valid keys here" not in problem


def test_axolotl_adapter_value_is_answered(tmp_path: Path) -> None:
    recipe = tmp_path / "axolotl.yaml"
    recipe.write_text("base_model: org/model\nadapter: qlora\n")
    with pytest.raises(C.ConfigError) as err:
        C.load(recipe)
    assert err.value.problems == [f"{recipe}:2: adapter: adapter is a section in spotune: write adapter.method: qlora"]


def test_two_names_for_one_key_in_one_source(tmp_path: Path) -> None:
    recipe = tmp_path / "both.yaml"
    recipe.write_text("learning_rate: 1e-4\ntrain:\n  lr: 2e-4\n")
    with pytest.raises(C.ConfigError) as err:
        C.load(recipe)
    assert err.value.problems == [f"{recipe}:3: train.lr: train.lr is also set by learning_rate; keep one of them"]
    # control: the command line overriding the recipe under another name is the usual override
    recipe.write_text("learning_rate: 1e-4\n")
    assert C.load(recipe, ["train.lr=5e-4"]).train.lr == 5e-4


def test_each_alias_is_noted_in_the_log_once(caplog: pytest.LogCaptureFixture) -> None:
    aliases._noted.discard("num_train_epochs")
    with caplog.at_level(logging.WARNING, logger="trainer.config.aliases"):
        C.load(None, ["num_train_epochs=2"])
        C.load(None, ["num_train_epochs=3"])
    notes = [r.getMessage() for r in caplog.records if "num_train_epochs" in r.getMessage()]
    assert notes == ["config: num_train_epochs (override num_train_epochs=2) read as train.epochs"]


# ---------------------------------------------------------------------------- typed values


@pytest.mark.parametrize("typed", ["on", "off", "auto"])
def test_on_off_mean_what_was_typed(typed: str, tmp_path: Path) -> None:
    assert C.load(None, [f"model.activation_offload={typed}"]).model.activation_offload == typed
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  activation_offload: {typed}\n")
    assert C.load(recipe).model.activation_offload == typed


def test_yaml_booleans_stay_booleans_where_the_field_wants_one(tmp_path: Path) -> None:
    cfg = C.load(None, ["model.compile=on", "model.gradient_checkpointing=yes", "data.shuffle=no"])
    assert (cfg.model.compile, cfg.model.gradient_checkpointing, cfg.data.shuffle) == (True, True, False)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  name_or_path: yes\n  revision: 1234\n")
    cfg = C.load(recipe)
    assert (cfg.model.name_or_path, cfg.model.revision) == ("yes", "1234")  # str fields take the text
    with pytest.raises(C.ConfigError, match=r"model.activation_offload: expected one of 'off', 'on', 'auto', got True"):
        C.load(None, ["model.activation_offload=true"])  # `true` is no choice of it: refused, not read as on
    with pytest.raises(C.ConfigError, match=r"model.activation_offload: expected one of .* got 'maybe'"):
        C.load(None, ["model.activation_offload=maybe"])
    with pytest.raises(C.ConfigError, match=r"model.name_or_path: expected a string, got None"):
        C.load(None, ["model.name_or_path=null"])  # null is no text to take


# ---------------------------------------------------------------------------- file:line


def test_every_problem_names_its_file_and_line(tmp_path: Path) -> None:
    recipe = tmp_path / "x.yaml"
    recipe.write_text(
        "output_dir: runs/x\n"  # 1
        "model:\n"  # 2
        "  dtype: float64\n"  # 3
        "train:\n"  # 4
        "  epochs: 1\n"  # 5
        "  lr: -1\n"  # 6
        "  save_steps: 100\n"  # 7
        "  micro_batch_size: auto\n"  # 8
        "checkpoint:\n"  # 9
        "  keep_last: 1\n"  # 10
        "  kep_last: 3\n"  # 11
    )
    with pytest.raises(C.ConfigError) as err:
        C.load(recipe, ["data.seq_len=0"])
    got = sorted(err.value.problems)
    want = sorted(
        [
            f"{recipe}:7: train.save_steps: " + ANSWERS["save_steps"].format(value=100),
            f"{recipe}:3: model.dtype: expected one of 'float32', 'bfloat16', 'float16', got 'float64'; did you mean 'float16'?",
            f"{recipe}:11: checkpoint.kep_last: unknown key; did you mean checkpoint.keep_last?",
            f"{recipe}:6: train.lr: must be above 0, got -1.0",
            f"{recipe}:10: checkpoint.keep_last: must be at least 2 so a committed checkpoint always survives, got 1",
            f"{recipe}:8: train.micro_batch_size: `auto` needs train.global_batch_size (the rows per optimizer step) "
            "and no train.grad_accum; set train.global_batch_size, or give micro_batch_size a number",
            "override data.seq_len=0: data.seq_len: must be at least 1, got 0",
        ]
    )
    assert got == want


def test_problems_inside_a_list_of_sources_name_their_line(tmp_path: Path) -> None:
    """`data.sources` entries are sections too: their keys, values and roles are checked at load,
    each problem named by its file and line (sharegpt_roles values included)."""
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(
        "data:\n"  # 1
        "  sharegpt_roles:\n"  # 2
        "    narrator: usr\n"  # 3
        "    bot: assistant\n"  # 4
        "  sources:\n"  # 5
        "    - path: a.jsonl\n"  # 6
        "      colour: red\n"  # 7
        "    - path: b.jsonl\n"  # 8
        "      format: sharegtp\n"  # 9
        "      rows: 0\n"  # 10
        "    - path: c.jsonl\n"  # 11
        "      format: text\n"  # 12
    )
    with pytest.raises(C.ConfigError) as err:
        C.load(recipe, [])
    assert sorted(err.value.problems) == sorted(
        [
            f"{recipe}:3: data.sharegpt_roles.narrator: 'usr' is not a role; map the speaker to one of "
            "system, user, assistant, tool, tool_call",
            f"{recipe}:7: data.sources[0].colour: unknown key; valid keys here: "
            + ", ".join(
                f"data.sources[0].{k}"
                for k in ("path", "subset", "split", "revision", "format", "fields", "rows", "fraction")
            ),
            f"{recipe}:9: data.sources[1].format: expected one of 'auto', 'alpaca', 'prompt_completion', 'messages', "
            "'sharegpt', 'text', 'chat', 'preference' or null, got 'sharegtp'; did you mean 'sharegpt'?",
            f"{recipe}:10: data.sources[1].rows: must be at least 1, got 0",
        ]
    )
    # The control: the same entries, fixed, load (and the third source's format is kept).
    fixed = recipe.read_text().replace("usr", "user").replace("      colour: red\n", "")
    recipe.write_text(fixed.replace("sharegtp", "sharegpt").replace("rows: 0", "rows: 2"))
    cfg = C.load(recipe, [])
    assert [s.format for s in cfg.data.sources] == [None, "sharegpt", "text"]


def test_a_problem_with_a_default_names_no_line(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  epochs: 1\n")
    with pytest.raises(C.ConfigError) as err:
        C.load(recipe, ["train.max_cost=5"])
    assert err.value.problems == [
        "override train.max_cost=5: train.max_cost: needs metrics.price_per_hour to turn device-hours into cost; "
        "set metrics.price_per_hour"
    ]


def test_invalid_yaml_and_a_non_mapping_name_the_line(tmp_path: Path) -> None:
    recipe = tmp_path / "broken.yaml"
    recipe.write_text("train:\n  max_steps: 3\n   lr: [\n")
    with pytest.raises(C.ConfigError, match=rf"{recipe}:3: invalid YAML at line 3, column 6"):
        C.load(recipe)
    recipe.write_text("- a\n- b\n")
    with pytest.raises(C.ConfigError, match=rf"{recipe}:1: the recipe must be a YAML mapping"):
        C.load(recipe)


def test_docs_name_every_alias_and_answer() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    missing = [name for name in [*ALIASES, *ANSWERS] if f"`{name}`" not in page]
    assert not missing, f"docs/config.md lacks {missing}"
    for alias in ALIASES.values():
        assert f"`{alias.key}`" in page


def test_an_override_is_named_without_its_secrets() -> None:
    with pytest.raises(C.ConfigError) as err:
        C.load(None, ["checkpoint.remote=s3://AKIA:pw@bucket/run?X-Amz-Signature=1", "train.lr=-1"])
    msg = str(err.value)
    assert "override checkpoint.remote=s3://bucket/run: checkpoint.remote: the URL carries credentials" in msg
    assert "pw@" not in msg and "Signature=1" not in msg
    assert "override train.lr=-1: train.lr: must be above 0" in msg  # control: a plain value is shown
    with pytest.raises(C.ConfigError) as err:
        C.load(None, ["checkpoint.storage_options={key: AKIA, secret: hunter2}"])
    assert "hunter2" not in str(err.value) and "AKIA" not in str(err.value)
    assert "override checkpoint.storage_options=...: checkpoint.storage_options.secret:" in str(err.value)


def test_a_key_given_twice_in_a_recipe_names_both_lines(tmp_path: Path) -> None:
    """YAML keeps the last silently: a second `train:` would drop every key of the first."""
    recipe = tmp_path / "twice.yaml"
    recipe.write_text("train:\n  lr: 1e-4\nmodel:\n  dtype: float32\ntrain:\n  epochs: 2\n  epochs: 3\n")
    with pytest.raises(C.ConfigError) as err:
        C.load(recipe)
    assert err.value.problems == [
        f"{recipe}:5: train: given twice (also {recipe}:1); keep one",
        f"{recipe}:7: train.epochs: given twice (also {recipe}:6); keep one",
    ]
    recipe.write_text("train:\n  lr: 1e-4\n  epochs: 3\n")  # control: once each
    assert C.load(recipe).train.epochs == 3


@pytest.mark.parametrize(
    ("pair", "expected"),
    [
        ("bf16: true\nfp16: false\n", "bf16"),  # how HF's TrainingArguments and Axolotl write bf16
        ("fp16: false\nbf16: true\n", "bf16"),  # in either order
        ("bf16: false\nfp16: true\n", "fp16"),
        ("bf16: false\nfp16: false\n", "no"),
        ("bf16: auto\nfp16: false\n", "auto"),  # Axolotl: bf16 where the GPU has it
        ("bf16: true\ntrain:\n  mixed_precision: bf16\n", "bf16"),  # two names, one setting
        ("fp16: false\ntrain:\n  mixed_precision: bf16\n", "bf16"),
    ],
)
def test_hf_precision_flags_read_as_a_pair(pair: str, expected: str, tmp_path: Path) -> None:
    recipe = tmp_path / "hf.yaml"
    recipe.write_text(pair + ("model:\n  dtype: float16\n" if expected == "fp16" else ""))
    assert C.load(recipe).train.mixed_precision == expected


@pytest.mark.parametrize(
    "pair", ["bf16: true\nfp16: true\n", "bf16: false\ntrain:\n  mixed_precision: bf16\n", "fp16: true\nbf16: auto\n"]
)
def test_precision_flags_that_disagree_are_named(pair: str, tmp_path: Path) -> None:
    """The control: two settings that each ask for something are still one too many."""
    recipe = tmp_path / "hf.yaml"
    recipe.write_text(pair)
    with pytest.raises(C.ConfigError, match="train.mixed_precision is also set by"):
        C.load(recipe)


def test_values_as_other_tools_write_them_in_any_section(tmp_path: Path) -> None:
    """HF's `max_steps: -1` is no limit (the epochs decide), and a value map applies where the name is
    a spotune key too (`train.optimizer: adamw_torch`)."""
    recipe = tmp_path / "hf.yaml"
    recipe.write_text("max_steps: -1\nnum_train_epochs: 2\ntrain:\n  optimizer: adamw_torch_fused\n")
    cfg = C.load(recipe)
    assert (cfg.train.max_steps, cfg.train.epochs, cfg.train.optimizer) == (None, 2.0, "adamw")
    assert C.load(None, ["train.max_steps=-1", "train.optimizer=adamw_bnb_8bit"]).train.optimizer == "adamw_8bit"
    assert C.load(None, ["train.max_steps=-1"]).train.max_steps is None
    with pytest.raises(C.ConfigError, match="train.max_steps: must be at least 1 or null, got -2"):
        C.load(None, ["max_steps=-2"])  # control: only HF's -1 means "no limit"


def test_bf16_auto_is_what_the_device_runs() -> None:
    """`auto` resolves to bf16 where the GPU computes it, else no: on this CPU, no (the accelerator
    built for the run and the config the run goes on with agree); a set precision stays as set."""
    import torch

    from trainer.training import process, run

    cfg = C.load(None, ["bf16=auto", "output_dir=/tmp/unused"])
    accelerator = process.make_accelerator(run.process_settings(cfg))
    expected = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    assert accelerator.mixed_precision == expected
    assert run.resolved_precision(cfg, accelerator).train.mixed_precision == expected
    fixed = C.load(None, ["bf16=true"])
    assert run.resolved_precision(fixed, accelerator) is fixed  # control: only `auto` is decided here


def test_did_you_mean_knows_the_aliases() -> None:
    """`train.learning_rat` is a misspelt `learning_rate` (read as train.lr), not the real key
    `train.min_lr_ratio`, which sets something else."""
    with pytest.raises(C.ConfigError) as e:
        C.load(None, ["model.name_or_path=x", "data.path=x.jsonl", "train.learning_rat=0.1"])
    assert "train.learning_rat: unknown key; did you mean train.learning_rate (read as train.lr)?" in str(e.value)
    assert "min_lr_ratio" not in str(e.value)
    with pytest.raises(C.ConfigError) as near:  # control: a misspelt spotune key still gets its own name
        C.load(None, ["model.name_or_path=x", "data.path=x.jsonl", "train.min_lr_rati=0.1"])
    assert "did you mean train.min_lr_ratio?" in str(near.value)
