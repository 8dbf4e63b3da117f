"""`python -m trainer` is the `spotune` CLI."""

from trainer.cli.main import run

run()
