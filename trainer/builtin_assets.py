"""Built-in offline assets: a tiny random model of a real architecture, its tokenizer, and a
synthetic instruction dataset such a model visibly learns.

They let the demo and the tests run the real loading code (`from_pretrained` on a directory
written by `save_pretrained`) on a fresh clone with no downloads. Everything is generated
deterministically and built into a temporary directory that is renamed into place, so
concurrent processes (two DDP ranks, parallel tests) never see a half-written asset.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from trainer.atomic import fsync_tree, temp_sibling
from trainer.config import BUILTIN_TINY_DATA, BUILTIN_TINY_MODEL

Arch = Literal[
    "llama",
    "qwen2",
    "mistral",
    "gpt2",
    "qwen3",
    "phi3",
    "gemma3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
]
"""Architectures of the recipes' model families (gemma3: the image-text model Gemma 3 4B/12B load as), and the
mixture-of-experts families transformers 5 ships with fused experts (3-D expert parameters)."""

MOE_ARCHES: tuple[Arch, ...] = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
)
"""The mixture-of-experts architectures a tiny model is built of (tests of expert LoRA, one per family)."""
ASSET_VERSION = "v5"  # bump when the generated assets change, so stale caches are not reused

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>\n{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}\n"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def home() -> Path:
    """Cache root for built-in assets: `$SPOTUNE_HOME`, else `~/.cache/spotune`."""
    return Path(os.environ.get("SPOTUNE_HOME", Path.home() / ".cache" / "spotune"))


def resolve_model(name_or_path: str) -> str:
    """`builtin:tiny-llama` -> a local directory with the tiny model and tokenizer; else unchanged."""
    if name_or_path != BUILTIN_TINY_MODEL:
        return name_or_path
    target = home() / f"tiny-llama-{ASSET_VERSION}"
    # init_std 0.1, not 0.02: LoRA leaves the final norm and the output head frozen, and a
    # random head at std 0.02 over 128 dims caps every logit near 2.6, flooring the loss at
    # about 4 nats whatever the adapter learns. A pretrained head has no such cap.
    return str(
        _build_once(target, lambda d: build_model(d, "llama", tokenizer_dir=None, hidden=128, layers=4, init_std=0.1))
    )


def resolve_data(path: str) -> str:
    """`builtin:tiny-instruct` -> a generated alpaca-format JSONL file; else unchanged."""
    if path != BUILTIN_TINY_DATA:
        return path
    target = home() / f"tiny-instruct-{ASSET_VERSION}"
    return str(_build_once(target, lambda d: write_dataset(d / "train.jsonl")) / "train.jsonl")


def _build_once(target: Path, build: Callable[[Path], object]) -> Path:
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(target)
    tmp.mkdir()
    try:
        build(tmp)
        fsync_tree(tmp)
        os.rename(tmp, target)  # atomic; fails if another process won the race
    except OSError:
        if not target.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------- dataset

_CAPITALS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Egypt": "Cairo",
    "Greece": "Athens",
}
_FRENCH = {
    "red": "rouge",
    "blue": "bleu",
    "green": "vert",
    "yellow": "jaune",
    "black": "noir",
    "white": "blanc",
}
_DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
# Three short-answer fact families, each asked three ways, the key in the alpaca `input`
# field. The answer depends only on the key (no copying), so a known key asked in a held-out
# phrasing tests what was learnt, not what was seen.
_FACTS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "capital": (
        (
            "What is the capital of this country?",
            "Name the capital city of the country below.",
            "Which city is the capital of this country?",
        ),
        _CAPITALS,
    ),
    "french": (
        (
            "How do you say this colour in French?",
            "What is this colour in French?",
            "Give the French word for this colour.",
        ),
        _FRENCH,
    ),
    "day": (
        ("Which day comes after this one?", "What day follows this day?", "Name the day after this one."),
        {d: _DAYS[(i + 1) % 7] for i, d in enumerate(_DAYS)},
    ),
}
# (family, key, phrasing) never trained on: every key is still trained in its other two phrasings.
HELD_OUT = (
    ("capital", "France", 2),
    ("capital", "Japan", 0),
    ("capital", "Egypt", 1),
    ("french", "red", 2),
    ("french", "green", 0),
    ("french", "black", 1),
    ("day", "Monday", 2),
    ("day", "Friday", 0),
)


def _fact(family: str, key: str, phrasing: int) -> dict[str, str]:
    templates, answers = _FACTS[family]
    return {"instruction": templates[phrasing], "input": key, "output": answers[key]}


def held_out_examples() -> list[dict[str, str]]:
    """The demo's held-out prompts: same task family as the training rows, none of them in it."""
    return [_fact(*h) for h in HELD_OUT]


def make_examples(n: int = 2000, seed: int = 0) -> list[dict[str, str]]:
    """Synthetic alpaca-style examples a tiny model learns in a few CPU-minutes, with real SFT's length mix.

    About 65% are short questions with a one-word answer (capitals, French colours, weekdays,
    each asked three ways, minus HELD_OUT); the rest ask for a plan of N days, one sentence per
    day, with N log-normal (median ~5, capped at 30): the long tail of multi-sentence answers
    real instruction data has. Both kinds are learnable: facts by heart, plans by rule.
    """
    rng = random.Random(seed)
    held = set(HELD_OUT)
    facts = [
        (family, key, i)
        for family, (templates, answers) in _FACTS.items()
        for key in answers
        for i in range(len(templates))
        if (family, key, i) not in held
    ]
    out: list[dict[str, str]] = []
    for _ in range(n):
        if rng.random() < 0.65:
            out.append(_fact(*rng.choice(facts)))
        else:
            # Long-tailed length: median ~5 sentences, p99 ~30 (the cap), like real SFT answers.
            days = min(int(rng.lognormvariate(1.5, 0.9)) + 1, 30)
            first = rng.randrange(7)
            out.append(
                {
                    "instruction": f"Plan {days} days starting on {_DAYS[first]}.",
                    "input": "",
                    "output": " ".join(f"Day {k + 1} is {_DAYS[(first + k) % 7]}." for k in range(days)),
                }
            )
    return out


def write_dataset(path: Path, n: int = 2000, seed: int = 0) -> Path:
    return _write_jsonl(path, make_examples(n, seed))


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def make_pairs(n: int = 200, seed: int = 0) -> list[dict[str, Any]]:
    """Preference pairs over the same tasks, in TRL's explicit conversational form (prompt, chosen and
    rejected as message lists): chosen is the right answer, rejected a wrong one of the same kind (another
    key's fact, or the plan that starts a day late)."""
    rng = random.Random(seed + 1)
    out: list[dict[str, Any]] = []
    for ex in make_examples(n, seed):
        family = next((f for f, (templates, _) in _FACTS.items() if ex["instruction"] in templates), None)
        if family is not None:
            wrong = rng.choice(sorted(set(_FACTS[family][1].values()) - {ex["output"]}))
        else:
            wrong = " ".join(
                f"Day {k + 1} is {_DAYS[(_DAYS.index(day.rstrip('.')) + 1) % 7]}."
                for k, day in enumerate(ex["output"].split()[3::4])
            )
        user = f"{ex['instruction']}\n\n{ex['input']}" if ex["input"] else ex["instruction"]
        out.append(
            {
                "prompt": [{"role": "user", "content": user}],
                "chosen": [{"role": "assistant", "content": ex["output"]}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
        )
    return out


def write_pairs(path: Path, n: int = 200, seed: int = 0) -> Path:
    """`make_pairs` as a JSONL file (tests and benchmarks)."""
    return _write_jsonl(path, make_pairs(n, seed))


# ---------------------------------------------------------------------------- tokenizer


def build_tokenizer(out_dir: Path | str, vocab_size: int = 1024) -> Path:
    """A byte-level BPE (any text encodes) trained on the synthetic corpus, saved for AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(ex.values()) for ex in make_examples(2000, seed=1)]
    corpus += ["### Instruction:\n### Input:\n### Response:\nBelow is an instruction that describes a task."]
    # The chat template's turn marks, so that alpaca rows rendered through it (what trains) stay short.
    corpus += ["<|system|>\n<|user|>\n<|assistant|>\n"] * 50
    tok.train_from_iterator(corpus, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out


# ---------------------------------------------------------------------------- models


def build_model(
    out_dir: Path | str,
    arch: Arch = "llama",
    *,
    tokenizer_dir: Path | str | None,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 4096,
    init_std: float = 0.02,
    experts: int = 8,
    top_k: int = 2,
) -> Path:
    """A tiny random-initialised model of a real architecture plus its tokenizer, in one directory (a mixture of
    experts: `experts` routed experts per layer, `top_k` of them per token)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        build_tokenizer(out)
    else:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = dict(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    ffn = intermediate or 2 * hidden
    if arch in MOE_ARCHES:
        config = _moe_config(arch, ids, hidden, layers, heads, kv_heads, ffn, max_positions, init_std, experts, top_k)
    else:
        config = _config(arch, ids, hidden, layers, heads, kv_heads, ffn, max_positions, init_std)
    from trainer.model.load import quiet_hf_progress

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with quiet_hf_progress():
        model.save_pretrained(out)
    return out


def _config(
    arch: Arch,
    ids: dict[str, Any],
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    max_positions: int,
    init_std: float,
) -> Any:
    """The transformers config of a tiny `arch` model."""
    import transformers

    if arch == "gpt2":
        config: Any = transformers.GPT2Config(
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_inner=ffn,
            n_positions=max_positions,
            initializer_range=init_std,
            **ids,
        )
    else:
        cls = {
            "llama": transformers.LlamaConfig,
            "qwen2": transformers.Qwen2Config,
            "mistral": transformers.MistralConfig,
            "qwen3": transformers.Qwen3Config,
            "phi3": transformers.Phi3Config,
            "gemma3": transformers.Gemma3TextConfig,
        }[arch]
        extra: dict = {"head_dim": hidden // heads} if arch in ("qwen3", "gemma3") else {}
        if arch == "phi3":
            extra["pad_token_id"] = ids["pad_token_id"] if ids["pad_token_id"] is not None else ids["eos_token_id"]
        config = cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=ffn,
            max_position_embeddings=max_positions,
            tie_word_embeddings=False,
            initializer_range=init_std,
            **(ids | extra),
        )
        if arch == "gemma3":  # as Gemma 3 4B/12B ship: the text model inside an image-text model
            vision = transformers.SiglipVisionConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            )
            top = ids["vocab_size"] - 1  # image tokens never occur in text data: any ids in the vocabulary do
            config = transformers.Gemma3Config(
                text_config=config,
                vision_config=vision,
                mm_tokens_per_image=4,
                image_token_index=top,
                boi_token_index=top - 1,
                eoi_token_index=top - 2,
                tie_word_embeddings=False,
                **ids,
            )
    return config


def _moe_config(
    arch: Arch,
    ids: dict[str, Any],
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    max_positions: int,
    init_std: float,
    experts: int = 8,
    top_k: int = 2,
) -> Any:
    """A tiny `arch` mixture-of-experts config: `experts` routed experts (top `top_k`) of width `ffn // 2` per
    layer, with each family's own extras (shared experts, MLA attention, a dense first layer) kept, small."""
    import transformers

    expert_ffn = ffn // 2
    common: dict[str, Any] = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        initializer_range=init_std,
        num_experts_per_tok=top_k,
        **ids,
    )
    # DeepSeek's latent attention (MLA) has as many key/value heads as query heads.
    mla: dict[str, Any] = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_experts=experts, moe_intermediate_size=expert_ffn)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common, num_experts=experts, moe_intermediate_size=expert_ffn, shared_expert_intermediate_size=ffn
        )
    if arch == "mixtral":
        return transformers.MixtralConfig(**(common | {"intermediate_size": expert_ffn}), num_local_experts=experts)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**(common | {"intermediate_size": expert_ffn}), num_experts=experts)
    if arch == "gpt_oss":
        return transformers.GptOssConfig(
            **(common | {"intermediate_size": expert_ffn}),
            num_local_experts=experts,
            head_dim=hidden // heads,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["full_attention"] * (layers % 2),
        )
    if arch == "deepseek_v2":
        return transformers.DeepseekV2Config(
            **(common | {"num_key_value_heads": heads}),
            **mla,
            n_routed_experts=experts,
            n_shared_experts=1,
            moe_intermediate_size=expert_ffn,
        )
    if arch == "deepseek_v3":  # its first layer dense, as the real models' first three
        return transformers.DeepseekV3Config(
            **(common | {"num_key_value_heads": heads}),
            **mla,
            n_routed_experts=experts,
            n_shared_experts=1,
            moe_intermediate_size=expert_ffn,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
        )
    return transformers.Glm4MoeConfig(
        **common,
        n_routed_experts=experts,
        n_shared_experts=1,
        moe_intermediate_size=expert_ffn,
        first_k_dense_replace=1,
    )
