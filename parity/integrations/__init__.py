"""RL frameworks' own batch objects read as they are, for the monitor and rollout dumps: `verl`
(`RayPPOTrainer.fit`'s `DataProto`), `nemo_rl` (GRPO's `train_data`), `slime` (`rollout_data`).
Each module has `read_batch`, `log_batch(monitor, step, batch)` and `dump_batch(batch, path)`, and
documents its key mapping; `batches` holds what they share. None of them imports its framework or
torch: tensors are read by duck typing.
"""
