"""What gets sampled: case files and their fields, prompts and datasets, built-in tools, and the
workload `compare` resolves from its arguments."""
