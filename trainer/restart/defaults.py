"""The numbers restart's behaviour is tuned by, each defined once, with why it is what it is.

The schema (trainer/config/schema.py) takes them as its dataclass defaults: that is where a user reads
them (with each key's docstring, and docs/config-reference.md) and overrides them. restart's own modules
take them as the defaults of their plain-value arguments, so a part built outside a run (a test, a tool)
behaves as a run does. This module imports nothing, so the schema, a lower stage, may import it
(tests/test_code_health.py `LEAVES`).
"""

SAVE_EVERY_MINUTES = 30.0
"""checkpoint.every_minutes: a spot VM lost loses at most this much work, for a save's cost twice an hour."""

KEEP_LAST = 3
"""checkpoint.keep_last: the newest committed checkpoint plus two to fall back on when it does not verify."""

NOTICE_SECONDS = 30.0
"""checkpoint.notice_seconds: GCP and Azure give a spot VM about 30 s between the notice and the kill (AWS 120 s)."""

NOTICE_POLL_SECONDS = 5.0
"""checkpoint.notice_poll_seconds: AWS recommends polling its spot notice every 5 s."""

LEASE_SECONDS = 180.0
"""checkpoint.lease_seconds: renewed every third of it, so a holder survives two missed renewals (a store's
slow minute) before a replacement machine may take a silent holder's run."""

STORE_OUTAGE_SECONDS = 900.0
"""checkpoint.store_outage_seconds: a store's outage of a quarter of an hour is trained through on local
checkpoints; a longer one ends the attempt (exit 143) rather than pile up work nobody has copied."""

STORE_RETRY_SECONDS = 120.0
"""checkpoint.store_retry_seconds: how long a start waits out a store's fault of the moment (throttling, 5xx)
before it exits 143 without training."""
