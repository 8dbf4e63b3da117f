"""The built-in demo, end to end on CPU with no downloads: prepare, train, interrupt, resume, report.

    python scripts/demo.py [extra key=value overrides]

It trains the tiny random Llama of `recipes/tiny-cpu.yaml` on the synthetic instruction set,
sends SIGTERM in the middle of the run (as a spot instance's notice would), checks the
requeue exit code, runs the very same command again to resume, then prints what the run
learnt and what it cost.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
RUN_DIR = REPO / "runs" / "demo"
EXIT_PREEMPTED = 143


def spotune(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", *args]


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def main() -> int:
    overrides = [f"output_dir={RUN_DIR}", "metrics.price_per_hour=0.50", *sys.argv[1:]]
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    banner("1. prepare: tokenise and pack once (cached)")
    subprocess.run(spotune("prepare", str(RECIPE), *overrides), check=True, cwd=REPO, env=env)

    banner("2. train, and interrupt it with SIGTERM after the first checkpoint")
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

    banner("3. resume: the very same command")
    code = subprocess.run(train_cmd, cwd=REPO, env=env).returncode
    if code != 0:
        print(f"demo: the resumed run failed with exit code {code}")
        return code

    banner("4. report")
    report()
    return 0


def report() -> None:
    rows = [json.loads(line) for line in (RUN_DIR / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first, last = rows[0], rows[-1]
    print(f"loss: {first['loss']:.3f} at step {first['step']} -> {last['loss']:.3f} at step {last['step']}")
    for key in ("sustained_tokens_per_s", "data_stall_share", "peak_memory_gib", "device_hours", "cost"):
        if last.get(key) is not None:
            value = last[key]
            print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    ledger = [json.loads(line) for line in (RUN_DIR / "ledger.jsonl").read_text().splitlines() if line.strip()]
    print(f"attempts: {len(ledger)} ({', '.join(str(r.get('exit_reason')) for r in ledger)})")
    total = sum(r.get("device_seconds", 0.0) for r in ledger)
    productive = sum(r.get("productive_seconds", 0.0) for r in ledger)
    if total:
        print(f"goodput: {productive / total:.1%} of {total:.1f} device-seconds")
    print(f"final adapter: {RUN_DIR / 'final'}")
    sample_generation()


def sample_generation() -> None:
    """Greedy answers from base + final adapter, loaded with plain peft, to show what was learnt."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.data.template import alpaca_prompt

    final = RUN_DIR / "final"
    tok = AutoTokenizer.from_pretrained(final)
    base_path = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), final).eval()
    prompt = alpaca_prompt("What is the capital of France?", "")  # the template training used
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    print(
        f"sample: 'What is the capital of France?' -> {tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)!r}"
    )


if __name__ == "__main__":
    sys.exit(main())
