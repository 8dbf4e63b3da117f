"""The built-in demo, end to end on CPU with no downloads: prepare, train, interrupt, resume, report.

    python scripts/demo.py [extra key=value overrides]

It trains the tiny random Llama of `recipes/tiny-cpu.yaml` on the synthetic instruction set
(short questions plus long multi-sentence answers, the length mix of real SFT data). First it
shows what packing saves against padding; then it scores the untrained model on held-out
questions, trains, sends SIGTERM in the middle of the run (as a spot instance's notice
would), checks the requeue exit code, runs the very same command again to resume, and ends
with the held-out score of the trained adapter, what the run cost and where its report is.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.exit_codes import EXIT_PREEMPTED  # noqa: E402

RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
RUN_DIR = REPO / "runs" / "demo"
MAX_NEW_TOKENS = 8
"""The longest greedy answer the demo asks for (its answers are one or two words)."""
# 512-token rows hold ~6 examples each, so packing can close its rows (at 256 a row of three
# 68-token questions has no room for a fourth). Two rows a step, 200 steps: the recipe's tokens
# (80 x 8 x 256) in more, smaller steps, which is what binding 19 facts to their keys needs
# (measured: 80 steps of 4 x 512 rows leave the held-out score at 0/8, 200 of 2 x 512 reach 7/8).
DEMO_OVERRIDES = [
    "data.seq_len=512",
    "train.micro_batch_size=2",
    "train.grad_accum=1",
    "train.max_steps=200",
    "train.lr=0.004",
    "checkpoint.every_steps=50",
]


def spotune(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", *args]


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def main() -> int:
    overrides = [f"output_dir={RUN_DIR}", "metrics.price_per_hour=0.50", *DEMO_OVERRIDES, *sys.argv[1:]]
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    banner("1. prepare: tokenise and pack once (cached)")
    subprocess.run(spotune("prepare", str(RECIPE), *overrides), check=True, cwd=REPO, env=env)
    print(packing_comparison(newest_manifest()))

    banner("2. before training: the base model on held-out questions")
    from trainer import builtin_assets
    from trainer.config import BUILTIN_TINY_MODEL

    before = score(builtin_assets.resolve_model(BUILTIN_TINY_MODEL), adapter=None)
    print(f"base model: {before.correct}/{before.total} held-out questions answered exactly")

    banner("3. train, and interrupt it with SIGTERM after the first checkpoint")
    train_cmd = spotune("train", str(RECIPE), *overrides, "metrics.progress=false")
    proc = subprocess.Popen(train_cmd, cwd=REPO, env=env)
    checkpoints = RUN_DIR / "checkpoints"
    while proc.poll() is None and not any(
        p.name.startswith("step-") and ".tmp" not in p.name
        for p in (checkpoints.iterdir() if checkpoints.exists() else [])
    ):
        time.sleep(0.2)
    if proc.poll() is None:
        time.sleep(1.0)  # a little work after the checkpoint, so the stop is mid-interval
        proc.send_signal(signal.SIGTERM)
    code = proc.wait()
    print(
        f"demo: the interrupted run exited with code {code} "
        f"({'preempted, checkpoint saved: requeue' if code == EXIT_PREEMPTED else 'unexpected'})"
    )
    if code not in (EXIT_PREEMPTED, 0):
        return code

    banner("4. resume: the very same command")
    code = subprocess.run(train_cmd, cwd=REPO, env=env).returncode
    if code != 0:
        print(f"demo: the resumed run failed with exit code {code}")
        return code

    banner("5. what it learnt, what it cost")
    after = score(builtin_assets.resolve_model(BUILTIN_TINY_MODEL), adapter=RUN_DIR / "final")
    print(f"held-out questions answered exactly: {before.correct}/{before.total} -> {after.correct}/{after.total}")
    for (prompt, answer), was, now in list(zip(after.cases, before.answers, after.answers, strict=True))[:2]:
        print(f"  asked {prompt!r} (answer {answer!r}): base {was!r} -> trained {now!r}")
    report()
    prompt, _ = after.cases[0]
    print(f"ask it yourself (the same greedy reply, {after.answers[0]!r}):")
    print(f"  {chat_command(RUN_DIR, prompt)}")
    return 0


def chat_command(run_dir: Path, prompt: str) -> str:
    """The `spotune chat` command that asks `prompt` as the demo did: greedy, as many new tokens; pasted
    into the shell the demo was started from, it runs (see `spotune_program`)."""
    return (
        f"{spotune_program()} chat {shlex.quote(_shown(run_dir))} --prompt {shell_quote(prompt)} "
        f"--temperature 0 --max-new-tokens {MAX_NEW_TOKENS}"
    )


def spotune_program() -> str:
    """`spotune` where the shell finds this environment's own; else the path of the script beside this
    Python (`make demo` never activates .venv: `.venv/bin/spotune`), else this Python with `-m trainer`."""
    script = Path(sys.executable).parent / "spotune"
    found = shutil.which("spotune")
    if found and script.is_file() and Path(found).resolve() == script.resolve():
        return "spotune"
    if script.is_file() and os.access(script, os.X_OK):
        return shlex.quote(_shown(script))
    return f"{shlex.quote(_shown(Path(sys.executable)))} -m trainer"


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it lies under it (`runs/demo`), else absolute; a
    relative one keeps a `./` or a folder, so the shell never looks it up on PATH."""
    try:
        return str(Path(os.path.abspath(path)).relative_to(Path.cwd()))
    except ValueError:
        return str(os.path.abspath(path))


def shell_quote(text: str) -> str:
    """`text` as one shell word on one line: bash's $'...' where it holds a newline (an alpaca input)."""
    if "\n" not in text:
        return shlex.quote(text)
    return "$'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def newest_manifest() -> dict[str, Any]:
    found = sorted((RUN_DIR / "data").glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
    return dict(json.loads(found[-1].read_text()))


def packing_comparison(manifest: dict[str, Any]) -> str:
    """What packing saves against padding each batch to its longest example, from the manifest."""
    st, seq_len = manifest["train"], manifest["settings"]["seq_len"]
    packed, padded = st["packing_efficiency"], st["baseline"]["efficiency"]
    batch = st["baseline"]["batch_size"]
    ratio = packed / padded
    return "\n".join(
        [
            f"packing: {st['examples_out']:,} examples -> {st['rows']:,} rows of {seq_len} tokens, "
            f"{packed:.1%} of every row is real tokens",
            f"padding: {st['examples_out']:,} rows (one per example), random batches of {batch} padded to their "
            f"longest: {padded:.1%} real tokens",
            f"=> padding computes {ratio:.2f}x the token slots for the same data: at equal compute, packing "
            f"trains {ratio:.2f}x the real tokens/s, in 1/{ratio:.2f} of the steps and GPU-hours",
        ]
    )


class Score:
    def __init__(self, cases: list[tuple[str, str]], answers: list[str]) -> None:
        self.cases, self.answers = cases, answers
        self.total = len(cases)
        self.correct = sum(a == expected for (_, expected), a in zip(cases, answers, strict=True))


def score(base: str, adapter: Path | None) -> Score:
    """Greedy answers of the base model (or base + adapter, loaded with plain peft) to the held-out
    questions; exact match of the whole answer, as a user would judge it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer import builtin_assets
    from trainer.data.formats import alpaca_messages
    from trainer.model.load import peft_wrapping, quiet_hf_progress

    # final/ carries the chat template the run trained with: ask through it, as a server would
    tok = AutoTokenizer.from_pretrained(adapter if adapter is not None else base)
    with quiet_hf_progress():
        model = AutoModelForCausalLM.from_pretrained(base)
    if adapter is not None:
        from peft import PeftModel

        with peft_wrapping():
            model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    held_out = builtin_assets.held_out_examples()
    # What is asked is the user turn as trained: the alpaca input follows the instruction after a blank line.
    cases = [(alpaca_messages(ex["instruction"], ex["input"])[-1]["content"], ex["output"]) for ex in held_out]
    answers = []
    for ex in held_out:
        prompt = tok.apply_chat_template(
            alpaca_messages(ex["instruction"], ex["input"]), tokenize=False, add_generation_prompt=True
        )
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids  # as trained
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        answers.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return Score(cases, answers)


def report() -> None:
    rows = [json.loads(line) for line in (RUN_DIR / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first, last = rows[0], rows[-1]
    ledger = [json.loads(line) for line in (RUN_DIR / "ledger.jsonl").read_text().splitlines() if line.strip()]
    total = sum(r.get("device_seconds", 0.0) for r in ledger)
    productive = sum(r.get("productive_seconds", 0.0) for r in ledger)
    print(f"loss: {first['loss']:.3f} at step {first['step']} -> {last['loss']:.3f} at step {last['step']}")
    speed = last.get("sustained_tokens_per_s")
    cost = last.get("cost")
    print(
        f"sustained {speed:,.0f} tokens/s; {len(ledger)} attempts "
        f"({', '.join(str(r.get('exit_reason')) for r in ledger)}); "
        + (f"goodput {productive / total:.0%} of {total:.0f} device-seconds; " if total else "")
        + (f"cost ${cost:.4f} at $0.50/hour" if cost is not None else "")
    )
    print(f"adapter: {RUN_DIR / 'final'}")
    html = RUN_DIR / "report.html"
    print(f"report:  {html}" if html.exists() else f"report:  run `spotune report {RUN_DIR}` for report.html")


if __name__ == "__main__":
    sys.exit(main())
