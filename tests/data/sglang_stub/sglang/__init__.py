"""A stand-in for SGLang's `launch_server` module, for tests/test_backends_sglang.py's launch tests."""
