"""How long does `spotune chat` take per reply on a tiny model once it has loaded?

The built-in tiny Llama (about 0.9M parameters with its LoRA adapter, a fresh adapter saved as a run
would) answers the same prompt, greedy, a fixed number of new tokens, on CPU: first with torch's own
intra-op threads (what chat did before), then with the threads chat now decodes with
(`trainer.serve.chat.decode_threads`: one for a small model). Rounds alternate, and each side counts
its fastest round, so a noisy shared machine moves the ratio less. Goal: under 1 s per reply of 64
tokens, and old/new > 1 on a machine whose cores are busy. Runs in about a minute:
    .venv/bin/python benchmarks/chat.py [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer import builtin_assets  # noqa: E402
from trainer import config as C  # noqa: E402
from trainer.serve.chat import Chat, ChatSource, Conversation, Sampling  # noqa: E402


def adapter(out: Path) -> ChatSource:
    """A fresh LoRA adapter on the built-in tiny Llama, saved with its tokenizer, as chat reads a run."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = builtin_assets.resolve_model(C.BUILTIN_TINY_MODEL)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    )
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return ChatSource(
        adapter_dir=out,
        base=base,
        tokenizer=str(out),
        tokenizer_revision=None,
        chat_template=None,
        model=C.ModelConfig(name_or_path=base),
        adapter=C.AdapterConfig(),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per reply (all of them: no early stop)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sampling = Sampling(max_new_tokens=args.tokens, temperature=0.0, min_new_tokens=args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        session = Chat(adapter(Path(tmp)), "cpu")
        print(f"loaded in {time.perf_counter() - started:.1f} s; torch's threads: {torch.get_num_threads()}")
        new_threads = session.threads
        sides = {"old (torch's threads)": None, f"new ({new_threads or 'torch'} thread(s))": new_threads}
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(args.rounds):
            for name, threads in sides.items():
                session.threads = threads
                t = time.perf_counter()
                session.reply(Conversation(), "Name the capital of France.", sampling, lambda _: None)
                best[name] = min(best[name], time.perf_counter() - t)
    for name, seconds in best.items():
        print(
            f"{name}: {seconds:.2f} s per reply of {args.tokens} tokens ({seconds / args.tokens * 1000:.1f} ms/token)"
        )
    old, new = best.values()
    print(f"old/new: {old / new:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
