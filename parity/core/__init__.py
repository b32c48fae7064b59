"""The words and file rows every part of parity shares: the schema (names, keys, versions), errors,
requests and rollouts, multi-turn turns, strict field checks, output paths and tables. No torch."""
