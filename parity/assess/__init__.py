"""The training side that builds a report: scoring rollouts with the training forward, the report's
assembly, accuracy against the gold forward and the sampling-mismatch probe."""
