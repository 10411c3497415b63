"""Predicting a deployment without running it: the step-cost profile (`pdserve profile`
measures one), the pool-split simulator (`pdserve simulate`, and the planner's model) and
the speculative-decoding calculator (`pdserve spec-sim`). Imports `settings/` only."""
