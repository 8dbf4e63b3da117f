"""What lets a run outlive its process and its machine.

- `checkpoint`: crash-consistent step checkpoints (commit, discovery, verification, pruning).
- `state`: what goes into a checkpoint (counters, RNG, optimizer) and the one restore function.
- `preemption`: signals and cross-rank agreement on when to stop.
- `ledger`: device-hours and cost across every attempt of the run.
- `storage`: the one seam to a remote store (fsspec): upload manifest last, verify, download, prune.
- `uploader`: the background thread that uploads committed checkpoints while training goes on.
- `remote`: `checkpoint.remote` for a run: connect, choose the resume step on rank 0, flush on exit.
"""
