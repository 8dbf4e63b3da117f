"""Planning: memory fit, GPU-hours and cost forecasts (estimate) and short measured pilots."""
