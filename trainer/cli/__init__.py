"""The `spotune` command line: `main` parses argv and hands each command to its own module."""
