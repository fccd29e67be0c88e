"""The scheduler: which requests run each step, its pure planning (plan_step, plan_restore),
per-request records and step costs."""
