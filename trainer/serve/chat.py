"""`spotune chat PATH`: talk to what a run trained, in the chat template it trained with.

PATH is a run directory (its `final/`, else its newest checkpoint that verifies: what
`spotune export` takes), `final/` itself, or one checkpoint directory. The base model and its
settings come from the run's config.yaml, read through the config loader; without one (an
exported adapter on its own) from adapter_config.json's `base_model_name_or_path`. The
tokenizer, and with it the chat template, is the one saved beside the adapter (final/ carries
the template the run trained with), else the run's `data.tokenizer` or the base model's, with
`data.chat_template` on top when the run set one.

Each turn is rendered the way the run's data was (`data.format`): every conversational format
(alpaca, messages, sharegpt, prompt/completion) trained through the chat template
(trainer/data/chat_templates.py), so the conversation goes through it too; `text` (or data that
met no template) is plain continuation. The reply streams token by token (transformers' TextStreamer); the history is
kept across turns, so every turn is rendered from the whole conversation.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import AutoTokenizer, GenerationConfig, TextStreamer

from trainer import builtin_assets
from trainer import config as C
from trainer.data.chat_templates import resolve_chat_template
from trainer.data.tokenizer import revision_of
from trainer.serve.export import adapter_source
from trainer.serve.final import GENERATION_CONFIG, served_generation_config

ADAPTER_CONFIG = "adapter_config.json"
EXIT_WORDS = ("/exit", "/quit")
CONVERSATIONAL = ("alpaca", "chat", "messages", "sharegpt")
"""Formats that always train through a chat template (`auto` and prompt/completion may be raw text)."""
RESET_WORD = "/reset"
SMALL_DECODE_PARAMS = 50_000_000
"""Below this many parameters a CPU decodes on one thread (`decode_threads`)."""


@dataclass(frozen=True)
class ChatSource:
    """Where each part of the chat comes from, resolved from PATH."""

    adapter_dir: Path
    base: str
    """The base model's local directory or hub id."""
    tokenizer: str
    """Directory (or id) the tokenizer and its chat template are loaded from."""
    tokenizer_revision: str | None
    chat_template: str | None
    """The run's `data.chat_template`, applied when the tokenizer is not the one saved with the adapter."""
    model: C.ModelConfig
    adapter: C.AdapterConfig
    format: str = "messages"
    """The run's `data.format`: how a conversation becomes a prompt (messages when no config.yaml says)."""


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 0.7
    """0 means greedy decoding."""
    top_p: float = 0.95
    seed: int | None = None
    min_new_tokens: int = 0
    """End-of-turn is not allowed before this many tokens (a barely trained adapter may stop at once)."""


@dataclass
class Conversation:
    """The turns so far, as the chat template reads them."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns


def _run_dir_of(adapter_dir: Path) -> Path | None:
    """The run directory above `final/` or `checkpoints/step-N/` (the one holding config.yaml)."""
    for candidate in (adapter_dir, adapter_dir.parent, adapter_dir.parent.parent):
        if (candidate / "config.yaml").is_file():
            return candidate
    return None


def find_source(path: Path | str) -> ChatSource:
    """Resolve PATH to the adapter, base model and tokenizer; ConfigError names what is missing."""
    path = Path(path)
    if not path.exists():
        raise C.ConfigError([f"{path} does not exist: give a run's output_dir, its final/ or a checkpoint"], "chat")
    adapter_dir = path if (path / ADAPTER_CONFIG).is_file() else adapter_source(path)
    run_dir = _run_dir_of(adapter_dir)
    cfg = C.from_dict(_yaml(run_dir / "config.yaml"), source=str(run_dir / "config.yaml")) if run_dir else None
    named = json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if cfg is not None:
        base = builtin_assets.resolve_model(cfg.model.name_or_path)
    elif named:
        base = str(named)
    else:
        raise C.ConfigError(
            [
                f"{adapter_dir / ADAPTER_CONFIG} names no base_model_name_or_path and no config.yaml is above it; "
                "set base_model_name_or_path to the base model's directory or hub id"
            ],
            "chat",
        )
    # final/ saves the tokenizer (with the template the run trained with); a run directory may hold one too
    saved = next((d for d in (adapter_dir, run_dir) if d is not None and (d / "tokenizer_config.json").is_file()), None)
    saved_tokenizer = saved is not None
    revision = None
    if saved is not None:
        tokenizer = str(saved)
    else:
        tokenizer = (cfg.data.tokenizer if cfg is not None else None) or base
        if cfg is not None:  # the weights' revision (or data.tokenizer_revision), as the run loaded it
            d = cfg.data
            revision = revision_of(d.tokenizer, d.tokenizer_revision, cfg.model.name_or_path, cfg.model.revision)
    return ChatSource(
        adapter_dir=adapter_dir,
        base=base,
        tokenizer=tokenizer,
        tokenizer_revision=revision,
        chat_template=None if saved_tokenizer or cfg is None else cfg.data.chat_template,
        model=cfg.model if cfg is not None else C.ModelConfig(name_or_path=base),
        adapter=cfg.adapter if cfg is not None else C.AdapterConfig(),
        format=cfg.data.format if cfg is not None else "messages",
    )


def _yaml(path: Path) -> dict[str, Any]:
    raw = yaml.safe_load(path.read_text())
    return raw if isinstance(raw, dict) else {}


class Chat:
    """The base model with the adapter, its tokenizer, and one conversation."""

    def __init__(self, source: ChatSource, device: str = "auto") -> None:
        from peft import PeftModel

        from trainer.model.load import load_base, peft_wrapping, quiet_hf_progress

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(source.tokenizer, revision=source.tokenizer_revision)
        if source.chat_template:  # a name (chatml, llama3, alpaca) or Jinja text, as the data pipeline reads it
            self.tokenizer.chat_template = resolve_chat_template(source.chat_template, self.tokenizer)
        if source.format in CONVERSATIONAL and not self.tokenizer.chat_template:
            raise C.ConfigError(
                [
                    f"{source.tokenizer} has no chat template: set data.chat_template in the run's config.yaml, "
                    "or save a tokenizer with one beside the adapter"
                ],
                "chat",
            )
        # sdpa: generation decodes one token at a time with a KV cache, which the packed-training
        # kernels (varlen, flex with document masks) are not for. 4-bit only where bitsandbytes runs it.
        model_cfg = dataclasses.replace(source.model, attn_implementation="sdpa", name_or_path=source.base)
        adapter_cfg = source.adapter
        if adapter_cfg.method == "qlora" and self.device.type != "cuda":
            adapter_cfg = dataclasses.replace(adapter_cfg, method="lora")
        base = load_base(model_cfg, adapter_cfg, device=self.device, progress=True)  # a fresh machine downloads it
        if adapter_cfg.method != "qlora":
            torch.nn.Module.to(base, self.device)  # in place (nn.Module.to); 4-bit weights were placed while loading
        with quiet_hf_progress(), peft_wrapping():
            self.model = PeftModel.from_pretrained(base, str(source.adapter_dir)).eval()
        self.source = source
        self.threads = decode_threads(sum(p.numel() for p in self.model.parameters()), self.device)
        # Stop where training ended a turn: final/'s generation config, else the one final/ would carry.
        if (source.adapter_dir / GENERATION_CONFIG).is_file():
            self.generation = GenerationConfig.from_pretrained(str(source.adapter_dir))
        else:
            self.generation = served_generation_config(base.generation_config, self.tokenizer, None, source.format)

    def reply(self, conversation: Conversation, text: str, sampling: Sampling, write: Callable[[str], None]) -> str:
        """Add the user's `text`, stream the assistant's answer through `write`, keep both turns."""
        conversation.turns.append({"role": "user", "content": text})
        enc = self.prompt(conversation)
        streamer = _Streamer(self.tokenizer, write)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        sample = sampling.temperature > 0
        with torch.inference_mode(), _threads(self.threads):
            self.model.generate(
                **{k: v.to(self.device) for k, v in enc.items()},
                max_new_tokens=sampling.max_new_tokens,
                min_new_tokens=sampling.min_new_tokens or None,
                do_sample=sample,
                temperature=sampling.temperature if sample else None,
                top_p=sampling.top_p if sample else None,
                pad_token_id=pad_id(self.tokenizer),
                eos_token_id=self.generation.eos_token_id,
                streamer=streamer,
            )
        answer = "".join(streamer.pieces).strip()
        conversation.turns.append({"role": "assistant", "content": answer})
        return answer

    def prompt(self, conversation: Conversation) -> Any:
        """The tokens the model continues from (input_ids + attention_mask), in the run's data format."""
        if self.source.format != "text" and self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(
                conversation.messages(), add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
        if self.source.format == "text":  # every token was trained: the conversation is text to continue
            text = "\n".join(t["content"] for t in conversation.turns) + "\n"
        else:  # data that met no template trained a raw prompt directly followed by its completion (template.py)
            text = "".join(t["content"] for t in conversation.turns)
        return self.tokenizer(text, add_special_tokens=True, return_tensors="pt")


def decode_threads(params: int, device: torch.device) -> int | None:
    """The CPU threads to decode with: one for a model under `SMALL_DECODE_PARAMS`, else torch's own (None).

    Decoding one token of a small model is a few hundred tiny ops; more threads only add their
    synchronisation, which on cores other processes keep busy costs far more than the ops themselves
    (benchmarks/chat.py: the 0.9M-parameter tiny Llama on two busy cores decoded 64 tokens in 11-14 s
    on torch's two threads, 2.7 s on one)."""
    return 1 if device.type == "cpu" and params < SMALL_DECODE_PARAMS else None


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the block (None: unchanged), restored after."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pad_id(tokenizer: Any) -> Any:
    """The id generation pads with: the tokenizer's pad token (id 0 is a token like any other), else EOS."""
    return tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id


class _Streamer(TextStreamer):
    """TextStreamer that writes each finished piece through `write` and keeps the text."""

    def __init__(self, tokenizer: Any, write: Callable[[str], None]) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.write = write
        self.pieces: list[str] = []

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.pieces.append(text)
        self.write(text)


def chat(
    path: Path | str,
    *,
    prompt: str | None,
    system: str | None,
    sampling: Sampling,
    device: str,
    read: Callable[[str], str],
    write: Callable[[str], None],
) -> int:
    """One reply to `prompt`, or a conversation read line by line until /exit or end of input."""
    source = find_source(path)
    started = time.perf_counter()
    say = f"spotune chat: loading {source.base} with the adapter {source.adapter_dir}"
    print(f"{say} ...", file=sys.stderr, flush=True)  # stderr: with --prompt, stdout is the answer alone
    session = Chat(source, device)
    print(f"spotune chat: loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    conversation = Conversation(system=system)
    if prompt is not None:
        session.reply(conversation, prompt, sampling, write)
        write("\n")
        return 0
    write(f"spotune chat: {session.source.adapter_dir} on {session.source.base} ({session.device}); ")
    write(f"{RESET_WORD} starts over, {EXIT_WORDS[0]} or Ctrl-D ends\n")
    while True:
        try:
            line = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt ends the conversation
            write("\n")
            return 0
        if line in EXIT_WORDS:
            return 0
        if line == RESET_WORD:
            conversation = Conversation(system=system)
            write("(history cleared)\n")
            continue
        if not line:
            continue
        write("assistant> ")
        try:
            session.reply(conversation, line, sampling, write)
        except KeyboardInterrupt:  # Ctrl-C stops this reply only; the unanswered turn is dropped
            if conversation.turns and conversation.turns[-1]["role"] == "user":
                conversation.turns.pop()
            write(" (stopped)")
        write("\n")
