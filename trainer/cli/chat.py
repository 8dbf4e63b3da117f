"""`spotune chat`: talk to a run's adapter on its base model, in the chat template it trained with."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "chat with a run's adapter (a run directory, its final/ or a checkpoint); --prompt for one reply"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=Path, help="the run's output_dir, its final/, or a checkpoints/step-N directory")
    p.add_argument("--prompt", help="answer this one message, print the reply and exit (for scripts)")
    p.add_argument("--system", help="a system message at the start of the conversation")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest reply, in tokens (default 256)")
    p.add_argument("--min-new-tokens", type=int, default=0, help="no end of turn before this many tokens (default 0)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0 is greedy (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--seed", type=int, help="seed the sampler, for a reply that repeats")
    p.add_argument("--device", default="auto", help="cuda, cpu, cuda:1 ... (default: cuda when there is one)")


def run(args: argparse.Namespace) -> int:
    from trainer.serve.chat import Sampling, chat

    try:
        import readline  # noqa: F401  # line editing and history for input(), where the platform has it
    except ImportError:
        pass

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.seed, args.min_new_tokens)
    return chat(
        args.path,
        prompt=args.prompt,
        system=args.system,
        sampling=sampling,
        device=args.device,
        read=input,
        write=write,
    )
