"""`spotune` command line: parse argv, hand the command to its module (trainer/cli/<command>.py),
turn the error that ends it into its exit code (`exit_codes.code_for`).

Exit codes are defined and documented once, in trainer/exit_codes.py: 0 finished,
143 preempted after saving, or any fault of the moment (requeue), 3 budget reached, 4 too many
non-finite steps, 130 aborted, 2 bad configuration or input (or store credentials to fix), 5 out of
GPU memory, 75 the run is held by another attempt, 1 anything else.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

from trainer import exit_codes
from trainer.cli import chat, config, estimate, export, flags, pilot, prepare, report, status, train
from trainer.exit_codes import EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_ERROR, EXIT_FINISHED, EXIT_PREEMPTED

# Every command, in the order `spotune --help` lists them: its module has HELP, add_arguments
# and run(args) -> exit code. Command modules never import one another.
COMMANDS: dict[str, ModuleType] = {
    "prepare": prepare,
    "inspect": prepare,
    "train": train,
    "status": status,
    "estimate": estimate,
    "pilot": pilot,
    "export": export,
    "report": report,
    "chat": chat,
    "config": config,
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spotune", description="Restart-safe LoRA/QLoRA fine-tuning.")
    ap.add_argument("--version", action="version", version=f"spotune {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        help_text = module.HELP[name] if isinstance(module.HELP, dict) else module.HELP
        module.add_arguments(sub.add_parser(name, help=help_text))
    return ap


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spotune")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed: pip install -e . in the repository)"


def main(argv: Sequence[str] | None = None) -> int:
    started = time.time()
    aborts = exit_codes.aborts()
    before = frozenset(c.pid for c in multiprocessing.active_children() if c.pid is not None)
    code = EXIT_ERROR  # what an exception that escapes (a traceback) exits with
    try:
        code = _main(argv)
    except SystemExit as e:  # a second SIGINT (130), argparse's 2
        code = e.code if isinstance(e.code, int) else (EXIT_FINISHED if e.code is None else EXIT_ERROR)
        raise
    finally:  # whatever ended the command, no child it started may hold the process open
        if any(c.pid not in before for c in multiprocessing.active_children()):
            from trainer.training.shutdown import end_child_processes  # torch: only when there is one

            end_child_processes(keep=before)
        if "torch.distributed" in sys.modules:  # torch was imported: a rank may hold a process group
            from trainer.model.distributed import end_process_group

            end_process_group()
        if exit_codes.aborts() > aborts:  # the second Ctrl-C's exit may have been swallowed: the run ended anyway
            code = EXIT_ABORTED
        _record_exit_code(code, started)
    return code


def run() -> NoReturn:
    """The `spotune` command and `python -m trainer`: `main`, then the process ends with its code.

    A second Ctrl-C whose SystemExit was swallowed (`exit_codes.abort`) interrupted code that ignores
    exceptions, a C extension's initialisation among them (matplotlib's, importing for the end-of-run report:
    "ImportError: initialization failed"); the interpreter's teardown then crashed on what it left half
    done (SIGABRT, not 130). The user asked to stop at once: after `main` has recorded everything, the
    process ends here without that teardown."""
    code = main()
    if exit_codes.aborts():  # main returned, so the abort's SystemExit never reached it: it was swallowed
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _record_exit_code(code: int, started: float | None = None) -> None:
    """Under a launcher that sets SPOTUNE_EXIT_FILE, every rank merges its code into it: the file
    ends with the most specific of the ranks' codes (trainer/exit_codes.py, `PRIORITY`)."""
    try:
        exit_codes.record(code, since=time.time() if started is None else started)
    except OSError as e:  # the code itself still reaches the launcher as this process's exit status
        print(
            f"spotune: could not write the exit code to {os.environ.get(exit_codes.EXIT_FILE_ENV)}: {e}",
            file=sys.stderr,
        )


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    wrong = flags.answers(argv, parser)  # `--max-steps 10`: the override to write, not argparse's bare refusal
    if wrong:
        print("\n".join(f"spotune: {line}" for line in wrong), file=sys.stderr)
        return EXIT_BAD_INPUT
    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except Exception as e:
        code = exit_codes.code_for(e)  # the one classifier; another rank of the run gets the same answer
        if code == EXIT_ERROR:
            raise  # a bug: the traceback says where
        # Each message is complete sentences naming the key, file, line, permission or holder; a
        # traceback would only bury it.
        print(f"spotune: {e}", file=sys.stderr)
        if code == EXIT_PREEMPTED:  # a fault of the moment (store, hub, network): restartable, never "bad input"
            print(
                f"spotune: that is a fault of the moment (the network, the store or the hub): exit {EXIT_PREEMPTED}; "
                "run the same command again",
                file=sys.stderr,
            )
        return code


def _dispatch(args: argparse.Namespace) -> int:
    return int(COMMANDS[args.command].run(args))


if __name__ == "__main__":
    run()
