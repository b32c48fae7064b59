"""A parity process running vLLM engines, for tests/test_no_orphans.py: the offline engine and a
vllm-server (started side by side, as a nightly run would hold them), or with the argument
`offline` the offline engine alone, then generating in a loop until it is killed. Prints READY once
every engine answers."""

import sys
import threading

from parity.backends import shared_backend
from parity.core.types import Request, SamplingParams

if __name__ == "__main__":
    with_server = sys.argv[1:] != ["offline"]
    started = {}

    def start_server():
        started["server"] = shared_backend("vllm-server", "tiny-llama")

    server = threading.Thread(target=start_server)
    if with_server:
        server.start()
    offline = shared_backend("vllm", "tiny-llama")
    if with_server:
        server.join()
    backends = [offline, *started.values()]
    requests = [Request((1, 10 + i, 20 + i), SamplingParams(max_tokens=64, ignore_eos=True, seed=i), f"q{i}")
                for i in range(8)]
    for backend in backends:
        backend.generate(requests)
    print("READY", flush=True)
    while True:
        for backend in backends:
            backend.generate(requests)
