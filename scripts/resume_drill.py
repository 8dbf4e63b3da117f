"""The end-to-end resume drill of the GPU check: train, SIGKILL after a checkpoint, run the same command.

On a GPU: a ~1B random Llama (meta-llama/Llama-3.2-1B's shipped config, its vocabulary cut to the
tokenizer's) in bf16 on real instruction data; with `dry`, the built-in tiny Llama on CPU (`builtin:tiny-llama`,
which the trainer builds itself: the driver imports no transformers), 6 steps. The
checks are the same: the second process resumes from the newest checkpoint and finishes, the
ledger holds one row per attempt (`killed`, then `finished`), and report.html is written.
Sized to fit its part's cap in scripts/gpu_check.py: 30 steps of 8 rows of 2048 tokens on a GPU,
killed after the step-20 checkpoint.

    python scripts/resume_drill.py WORK [--data FILE --tokenizer DIR] [--dry] [--json RESULT]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer import builtin_assets as tiny  # noqa: E402
from trainer.config import BUILTIN_TINY_MODEL  # noqa: E402
from trainer.restart.local.checkpoint import CheckpointManager  # noqa: E402

SHIPPED_1B = REPO / "trainer" / "plan" / "models" / "meta-llama--Llama-3.2-1B.json"


def make_model(out: Path, tokenizer: Path | None, dry: bool) -> Path | str:
    """A random-initialised model saved with its tokenizer (no download)."""
    if dry and tokenizer is None:
        # The trainer builds (or finds cached) the built-in one: building it here would cost this
        # driver transformers' import, which the train processes pay anyway.
        return BUILTIN_TINY_MODEL
    tok_dir = tokenizer or tiny.build_tokenizer(out.parent / "tokenizer")
    if dry:
        return tiny.build_model(out, "llama", tokenizer_dir=tok_dir)
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tok_dir)
    config = LlamaConfig(**{**json.loads(SHIPPED_1B.read_text()), "vocab_size": len(tok)})
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def recipe(work: Path, model: Path | str, data: Path, dry: bool) -> dict[str, Any]:
    return {
        "output_dir": str(work / "run"),
        "seed": 1,
        "model": {"name_or_path": str(model), "dtype": "float32" if dry else "bfloat16"},
        "adapter": {"r": 16, "alpha": 32},
        # The Llama 2 tokenizer of a base model ships no chat template: the named Stanford prompt.
        "data": {"path": str(data), "format": "alpaca", "chat_template": "alpaca", "seq_len": 128 if dry else 2048},
        "train": {
            # dry: killed after the step-4 checkpoint, resumed for 2 steps (as the GPU's resumes for 10)
            "max_steps": 6 if dry else 30,
            "micro_batch_size": 2 if dry else 4,
            "grad_accum": 2,
            "lr": 2e-4,
            "mixed_precision": "no" if dry else "bf16",
        },
        "checkpoint": {"every_steps": 2 if dry else 10, "every_minutes": None},
        "metrics": {"progress": False, "log_every": 1, "warmup_steps": 1 if dry else 3},
    }


def drill(work: Path, *, data: Path | None, tokenizer: Path | None, dry: bool) -> tuple[bool, str, str]:
    """(passed, the figure, the log) of one kill-and-resume."""
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(work / "model", tokenizer, dry)
    data = data or tiny.write_dataset(work / "data.jsonl", n=400)
    cfg = recipe(work, model, data, dry)
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = Path(cfg["output_dir"])
    cmd = [sys.executable, "-m", "trainer", "train", str(path)]
    kill_after = 2 * cfg["checkpoint"]["every_steps"]
    manager = CheckpointManager(out / "checkpoints", keep_last=3)
    print(
        f"drill: attempt 1 ({cfg['train']['max_steps']} steps), SIGKILL after the step-{kill_after} checkpoint",
        flush=True,
    )
    with open(work / "attempt1.log", "w") as log:
        first = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while not any(int(p.name.split("-")[1]) >= kill_after for p in manager.committed()):
            if first.poll() is not None or time.monotonic() > deadline:
                first.kill()
                return False, f"attempt 1 ended before a checkpoint at step {kill_after}", _read(work / "attempt1.log")
            time.sleep(0.1)
        os.killpg(first.pid, signal.SIGKILL)  # the VM vanishes: no save, no ledger row
        first.wait()
    killed_at = max(int(p.name.split("-")[1]) for p in manager.committed())
    print(
        f"drill: attempt 1 killed with the step-{killed_at} checkpoint committed; attempt 2 (the same command)",
        flush=True,
    )
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    log = _read(work / "attempt1.log") + "\n--- attempt 2 ---\n" + second.stdout + second.stderr
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    reasons = [row["exit_reason"] for row in ledger]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
    problems = []
    if second.returncode != 0:
        problems.append(f"attempt 2 exited {second.returncode}")
    if f"at step {killed_at} of" not in second.stdout + second.stderr:
        problems.append(f"attempt 2 did not resume from step {killed_at}")
    if reasons != ["killed", "finished"]:
        problems.append(f"ledger reasons {reasons}, expected ['killed', 'finished']")
    if not (out / "report.html").is_file():
        problems.append("no report.html")
    if not (out / "final" / "adapter_model.safetensors").is_file():
        problems.append("no final adapter")
    figure = (
        f"SIGKILL after the step-{killed_at} checkpoint, resumed there and finished step {cfg['train']['max_steps']}; "
        f"ledger {reasons}; {rates[-1]:.0f} tokens/s at the end"
        if rates
        else f"ledger {reasons}"
    )
    if problems:
        figure = "; ".join(problems) + f" ({figure})"
    return not problems, figure, log[-8000:]


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path)
    ap.add_argument("--data", type=Path)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--dry", action="store_true", help="the built-in tiny Llama on CPU (CI)")
    ap.add_argument("--json", type=Path, help="write {ok, figure} here")
    a = ap.parse_args()
    ok, fig, log = drill(a.work, data=a.data, tokenizer=a.tokenizer, dry=a.dry)
    print(log)
    print(("pass: " if ok else "fail: ") + fig)
    if a.json:
        a.json.write_text(json.dumps({"ok": ok, "figure": fig}))
    sys.exit(0 if ok else 1)
