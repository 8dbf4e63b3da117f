"""`python -m trainer` is the `spotune` CLI."""

import sys

from trainer.cli.main import main

sys.exit(main())
