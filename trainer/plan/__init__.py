"""Planning: memory fit, GPU-hours and cost forecasts (`spotune estimate`) and short measured pilots (`spotune pilot`)."""

from trainer.exit_codes import EXIT_BAD_INPUT


class PlanError(ValueError):
    """A bad planning input (flag, catalogue file, pilot result); the message names the fix."""

    exit_code = EXIT_BAD_INPUT
