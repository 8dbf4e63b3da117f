"""The training process: which rows each step trains on (sampler), a step's micro-batches
(batches), the loop, the meter and its sinks (metrics, telemetry), and the wiring of `train` (run)."""
