"""RL frameworks' own batch objects read as they are, for the monitor and rollout dumps: `verl`,
`nemo_rl`, `slime` (`read_batch`, `log_batch`, `dump_batch`, each with its key mapping); neither
the frameworks nor torch are imported.
"""
