"""What lets a run outlive its process and its machine.

- `checkpoint`: crash-consistent step checkpoints (commit, discovery, verification, pruning).
- `state`: what goes into a checkpoint (counters, RNG, optimizer) and the one restore function.
- `preemption`: signals and cross-rank agreement on when to stop.
- `ledger`: device-hours and cost across every attempt of the run.
"""
