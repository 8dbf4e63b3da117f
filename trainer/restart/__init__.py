"""What lets a run outlive its process and its machine.

- `checkpoint`: crash-consistent step checkpoints (commit, discovery, verification, pruning).
- `state`: what goes into a checkpoint (counters, RNG, optimizer) and the one restore function.
- `preemption`: signals and cross-rank agreement on when to stop.
- `ledger`: device-hours and cost across every attempt of the run.
- `storage`: the one seam to a remote store (fsspec): upload manifest last, verify, download, prune.
- `safety`: the rule that nothing paid for is deleted, which every deleting store write asks.
- `uploader`: the background thread that uploads committed checkpoints while training goes on.
- `remote`: `checkpoint.remote` for a run: connect, choose the resume step on rank 0, flush on exit.
- `lease`, `reclaim`, `handover`: one writer per remote prefix (lock and fence, cut off and back,
  the ledger's records of earlier holders).
"""
