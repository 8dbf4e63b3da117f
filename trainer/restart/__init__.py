"""What lets a run outlive its process and its machine, one sub-folder per concern (lowest first; a part
imports its own and lower parts only, tests/test_code_health.py `RESTART_PARTS`):

- `defaults`: the numbers restart is tuned by, with why (the schema's defaults; imports nothing).
- `agree`: ranks that decide together (rank 0's answer, or its failure's exit code, on every rank).
- `signals/`: the stop paths (signals, cloud notices, a dead launcher) and the one stop flag.
- `books/`: the ledger (one row per paid attempt), its heartbeat and hand-over, the clocks they keep.
- `local/`: this disk's checkpoints: what one holds, commit, verify, prune, choose; the one save.
- `store/`: `checkpoint.remote`: transport, verification, lifecycle, the safety rule, generations.
- `ownership/`: one writer per run: the directory's lock, the store's lease, cut off and back.
- `remote/`: what an attempt asks of the store: connect, a resume request once, choose, upload, flush.
"""
