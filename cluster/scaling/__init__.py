"""Elastic pools: drains, role changes, adds and removals (`elastic.py`), and the planner
that sizes the pools to latency targets from the load the workers report. Imports
`serving/`, `sim/` and `settings/`."""
