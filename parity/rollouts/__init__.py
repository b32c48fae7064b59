"""Rollouts on disk, checked: recorded runs (JSONL), dumps from other frameworks, and the matching
of rollouts to the requests they answer."""
