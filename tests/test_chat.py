"""`spotune chat` on a real tiny run (recipes/tiny-cpu.yaml, a few steps): the run directory, its
final/ and a checkpoint resolve to the adapter and the chat template the run trained with; a
one-shot --prompt prints a streamed reply and exits 0; a conversation through a pseudo-terminal
keeps its history over two turns and ends at /exit; a bad path exits 2 naming it."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from trainer.cli.main import main as spotune
from trainer.exit_codes import EXIT_BAD_INPUT
from trainer.serve.chat import Chat, Conversation, Sampling, chat, find_source

REPO = Path(__file__).resolve().parents[1]
# A 4-step adapter tends to end its turn at once: the reply is held to some tokens to test streaming.
GREEDY = Sampling(max_new_tokens=24, temperature=0.0, min_new_tokens=8)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chat") / "run"
    overrides = [
        f"output_dir={out}",
        "train.max_steps=4",
        "checkpoint.every_steps=2",
        "metrics.progress=false",
        "metrics.report=false",
    ]
    assert spotune(["train", str(REPO / "recipes" / "tiny-cpu.yaml"), *overrides]) == 0
    return out


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_run_dir_final_and_checkpoint_resolve_to_the_trained_adapter_and_template(run_dir: Path) -> None:
    final = run_dir / "final"
    src = find_source(run_dir)
    assert src.adapter_dir == final and find_source(final) == src
    assert src.tokenizer == str(final) and src.model.name_or_path == "builtin:tiny-llama"
    assert Path(src.base).is_dir() and src.adapter.r == 16
    step = run_dir / "checkpoints" / "step-000002"
    ckpt = find_source(step)
    assert ckpt.adapter_dir == step and ckpt.tokenizer == ckpt.base  # a checkpoint carries no tokenizer
    # The template the chat renders with is the one final/ carries, i.e. the one the run trained with.
    session = Chat(src, "cpu")
    assert session.tokenizer.chat_template == (final / "chat_template.jinja").read_text()
    # A chat-format run is prompted through that template, generation prompt included.
    session.source = dataclasses.replace(src, format="chat")
    turns = [{"role": "user", "content": "hi"}]
    fed = session.prompt(Conversation(system="be brief", turns=turns))["input_ids"][0].tolist()
    text = session.tokenizer.decode(fed)
    assert text.startswith("<s><|system|>\nbe brief\n<|user|>\nhi\n") and text.endswith("<|assistant|>\n")


def test_a_run_config_chat_template_is_applied_where_no_tokenizer_was_saved(run_dir: Path, tmp_path: Path) -> None:
    """A checkpoint has no tokenizer files: the run's data.chat_template (when it set one) goes on top."""
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (step / f).write_bytes((run_dir / "checkpoints" / "step-000002" / f).read_bytes())
    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    raw["data"]["chat_template"] = template
    (run / "config.yaml").write_text(yaml.safe_dump(raw))
    src = find_source(step)
    assert src.chat_template == template
    assert Chat(src, "cpu").tokenizer.chat_template == template
    # control: the run's own checkpoint, whose config sets none, keeps the base tokenizer's
    assert find_source(run_dir / "checkpoints" / "step-000002").chat_template is None


def test_reply_streams_in_pieces_and_the_history_carries_the_first_turn(run_dir: Path) -> None:
    session = Chat(find_source(run_dir), "cpu")
    conversation = Conversation(system="be brief")
    pieces: list[str] = []
    first = session.reply(conversation, "Name a color.", GREEDY, pieces.append)
    assert first and "".join(pieces).strip() == first and len(pieces) >= 2  # streamed, not printed at the end
    second = session.reply(conversation, "And another?", GREEDY, lambda _: None)
    assert [t["role"] for t in conversation.turns] == ["user", "assistant", "user", "assistant"]
    assert conversation.turns[1]["content"] == first and conversation.turns[3]["content"] == second
    rendered = session.tokenizer.decode(session.prompt(Conversation(turns=conversation.turns[:3]))["input_ids"][0])
    assert rendered.count("<|user|>") == 2 and first in rendered  # turn 2 saw the whole conversation
    # control: greedy decoding repeats itself, so a fresh conversation's first reply is the same
    assert session.reply(Conversation(system="be brief"), "Name a color.", GREEDY, lambda _: None) == first


def test_an_alpaca_run_is_prompted_with_the_tokens_it_trained_on(run_dir: Path) -> None:
    """Alpaca rows trained as conversations through the chat template: the prompt part (labels -100)
    of a prepared example is exactly what chat feeds for the same user turn; the Stanford alpaca
    prompt would be another prompt (control)."""
    import datasets

    from trainer.data.chat_templates import NAMED

    session = Chat(find_source(run_dir), "cpu")
    assert session.source.format == "auto"  # the recipe reads any format; the built-in data is alpaca
    (manifest,) = (run_dir / "data").glob("*/manifest.json")
    row = datasets.load_from_disk(str(manifest.parent / "train"))[0]
    end = [i for i, p in enumerate(row["position_ids"]) if p == 0][1:2] or [row["num_real"]]
    ids, labels = row["input_ids"][: end[0]], row["labels"][: end[0]]
    prompt = ids[: next(i for i, x in enumerate(labels) if x != -100)]
    text = session.tokenizer.decode(prompt)
    assert "<|system|>" not in text  # the tiny data has no system column
    user = text.split("<|user|>\n", 1)[1].rsplit("\n<|assistant|>", 1)[0]
    turns = [{"role": "user", "content": user}]
    assert session.prompt(Conversation(turns=turns))["input_ids"][0].tolist() == prompt
    stanford = session.tokenizer.apply_chat_template(
        turns, chat_template=NAMED["alpaca"], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert list(stanford) != prompt


def test_one_shot_prompt_prints_the_reply_and_exits_0(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert spotune(["chat", str(run_dir), "--prompt", "hi", "--max-new-tokens", "12", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert out.strip() and out.endswith("\n") and "you>" not in out
    # it says it is loading (on stderr: stdout is the answer alone), and when it has loaded
    assert "spotune chat: loading " in captured.err and "spotune chat: loaded in " in captured.err
    assert "loading" not in out


def test_a_small_model_decodes_on_one_cpu_thread(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads cost a small model's tiny per-token ops more than they give (benchmarks/chat.py measures it):
    the tiny model decodes on one thread, and torch's setting is restored after the reply."""
    from trainer.serve import chat as chat_module

    session = Chat(find_source(run_dir), "cpu")
    assert session.threads == 1
    seen: list[int] = []
    real = session.model.generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(session.model, "generate", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        session.reply(Conversation(), "hi", GREEDY, lambda _: None)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    # control: a large model, or a GPU, keeps torch's own setting
    assert chat_module.decode_threads(chat_module.SMALL_DECODE_PARAMS, torch.device("cpu")) is None
    assert chat_module.decode_threads(10, torch.device("cuda")) is None


def test_conversation_through_a_pseudo_terminal(run_dir: Path) -> None:
    pexpect: Any = pytest.importorskip("pexpect", reason="pip install pexpect (the test extra)")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "trainer", "chat", str(run_dir), "--max-new-tokens", "8", "--temperature", "0"],
        env=_env(),
        encoding="utf-8",
        timeout=240,
    )
    try:
        child.expect("/exit or Ctrl-D ends")
        for text in ("hi", "tell me more"):
            child.expect_exact("you> ")
            child.sendline(text)
            child.expect_exact("assistant> ")
        child.expect_exact("you> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_ctrl_c_stops_a_reply_and_at_the_prompt_ends_the_chat(run_dir: Path) -> None:
    """Ctrl-C while a reply streams stops that reply only (the next turn is answered); at the prompt it ends."""
    said: list[str] = []
    lines = iter(["hi", "again"])

    def read(prompt: str) -> str:
        line = next(lines, None)
        if line is None:
            raise KeyboardInterrupt
        return line

    interrupted: list[str] = []

    def write(text: str) -> None:
        said.append(text)
        if said[-2:-1] == ["assistant> "] and not interrupted:  # the first piece of the first reply
            interrupted.append(text)
            raise KeyboardInterrupt

    assert chat(run_dir, prompt=None, system=None, sampling=GREEDY, device="cpu", read=read, write=write) == 0
    text = "".join(said)
    first, second = text.split("assistant> ")[1:]
    assert interrupted and first == interrupted[0] + " (stopped)\n"
    assert second.strip() and "(stopped)" not in second


def test_generation_pads_with_the_pad_token_even_when_its_id_is_0(tiny_tokenizer: Path) -> None:
    from transformers import AutoTokenizer

    from trainer.serve.chat import pad_id

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    tok.pad_token = tok.convert_ids_to_tokens(0)
    assert tok.pad_token_id == 0 != tok.eos_token_id
    assert pad_id(tok) == 0
    tok.pad_token = None
    assert pad_id(tok) == tok.eos_token_id  # control: no pad token, EOS pads


def test_bad_path_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert spotune(["chat", str(tmp_path / "nope"), "--prompt", "hi"]) == EXIT_BAD_INPUT
    assert f"{tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert spotune(["chat", str(empty), "--prompt", "hi"]) == EXIT_BAD_INPUT
    assert "no final/ adapter and no verified checkpoint" in capsys.readouterr().err


def test_chat_and_merge_show_the_base_models_download(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a fresh machine `spotune chat` and `export --merge` download the base model first: both ask
    from_pretrained for the hub's download progress (a bar, or lines in a log file), as train does."""
    import transformers

    from trainer.model import load
    from trainer.serve.export import export

    monkeypatch.setattr(load, "_takes_download_bar", lambda: True)  # a transformers that reads tqdm_class
    real = transformers.AutoModelForCausalLM.from_pretrained
    seen: list[bool] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append("tqdm_class" in kwargs)
        kwargs.pop("tqdm_class", None)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    Chat(find_source(run_dir), "cpu")
    export(run_dir, tmp_path / "merged", merge=True)
    assert seen == [True, True]
    # The control: a load that asks for no progress passes no bar.
    from trainer import config as C

    load.load_base(C.ModelConfig(name_or_path=find_source(run_dir).base, dtype="float32"), C.AdapterConfig())
    assert seen == [True, True, False]
