"""Benchmarks: the pytest-benchmark files and the GPU machine script (`python3 -m benchmarks.gpu`)."""
