"""Process exit codes of every spotune command, defined once.

Supervisors (the docker entrypoint, SLURM, Kubernetes, SkyPilot templates under
scripts/launch/) decide from these whether to rerun the same command.

What a supervisor should do with each:
- `EXIT_FINISHED = 0`: training reached its end; `final/` holds the adapter. Do not rerun.
- `EXIT_ERROR = 1`: an unexpected error (a traceback); look at it before rerunning.
- `EXIT_BAD_INPUT = 2`: bad configuration or data, or a checkpoint that cannot be resumed;
  the message names the key, file or line to fix. Rerunning unchanged fails the same way.
- `EXIT_BUDGET = 3`: stopped at `train.max_gpu_hours` or `train.max_cost` after saving a
  checkpoint. Raise the budget and rerun the same command to continue.
- `EXIT_BAD_STEPS = 4`: `train.max_bad_steps` consecutive non-finite steps; fix the run
  (learning rate, data) before rerunning.
- `EXIT_OUT_OF_MEMORY = 5`: the GPU ran out of memory; the message names the step, the
  estimate's peak and what to change (micro-batch, gradient checkpointing, seq_len, QLoRA).
  Rerunning unchanged fails the same way on the same GPU: do not restart it.
- `EXIT_BUSY = 75` (EX_TEMPFAIL): another attempt holds the run (its directory's lock, or the
  lease in `checkpoint.remote`): refused at start, or this attempt lost the lease mid-run and
  stopped without writing more. Do not restart now: the holder is training. `spotune status`
  names it; `spotune train --wait SECONDS` resumes after it.
- `EXIT_ABORTED = 130`: a second SIGINT; no checkpoint was saved for the step in flight.
  Rerunning resumes from the last committed checkpoint.
- `EXIT_PREEMPTED = 143` (128 + SIGTERM): stopped by a signal after saving a checkpoint, or
  by `checkpoint.remote` staying unreachable past `checkpoint.store_outage_seconds` (a local
  checkpoint saved), or unreachable at start with no local checkpoint to train from.
  Rerun the same command to resume.
"""

from __future__ import annotations

from typing import Literal

EXIT_FINISHED = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_BUDGET = 3
EXIT_BAD_STEPS = 4
EXIT_OUT_OF_MEMORY = 5
EXIT_BUSY = 75
EXIT_ABORTED = 130
EXIT_PREEMPTED = 143

EXIT_FILE_ENV = "SPOTUNE_EXIT_FILE"
"""Where the main rank also writes its exit code. A launcher reads it because torchrun reports any
rank's non-zero exit as 1, which would turn a requeue (143) into an error (docker/entrypoint.sh)."""

StopReason = Literal["finished", "preempted", "budget", "bad_steps"]
"""Why the training loop returned."""

FOR_STOP: dict[str, int] = {
    "finished": EXIT_FINISHED,
    "preempted": EXIT_PREEMPTED,
    "budget": EXIT_BUDGET,
    "bad_steps": EXIT_BAD_STEPS,
}
"""The exit code of `spotune train` for each way the loop can stop."""
