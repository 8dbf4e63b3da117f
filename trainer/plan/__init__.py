"""Planning: memory fit, GPU-hours and cost forecasts (`spotune estimate`) and short measured pilots (`spotune pilot`)."""


class PlanError(ValueError):
    """A bad planning input (flag, catalogue file, pilot result); the message names the fix."""
