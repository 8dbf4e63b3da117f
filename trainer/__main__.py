"""`python -m trainer` is the `spotune` CLI."""

import sys

from trainer.cli import main

sys.exit(main())
