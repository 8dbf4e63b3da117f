"""This machine's checkpoints: what one holds (`state`, `rng`), how it is committed, verified, pruned and
chosen on this disk (`checkpoint`), and the one save the loop calls (`saving`)."""
