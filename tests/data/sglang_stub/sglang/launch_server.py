"""Serves SGLang's native routes with the documented-format outputs on the --port it is given.

Not SGLang (which does not run on these machines): it lets the adapter's `launch_server` path start
a process, wait for /health, read /get_server_info and stop it, and records what it was started
with (argv, SGLANG_RETURN_ORIGINAL_LOGPROB) in /get_server_info.
"""

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

DATA = Path(__file__).parents[2] / "documented_format"
DOCUMENTED = json.loads((DATA / "sglang_generate.json").read_text())
ARGV = sys.argv[1:]
FLUSHES = []


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            return self._reply({})
        self._reply({"version": "stub-launched", "argv": ARGV, "flushes": len(FLUSHES),
                     "return_original_logprob": os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB"),
                     "enable_deterministic_inference": "--enable-deterministic-inference" in ARGV,
                     "attention_backend": ARGV[ARGV.index("--attention-backend") + 1]
                     if "--attention-backend" in ARGV else None, "disable_radix_cache": False})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path == "/flush_cache":
            FLUSHES.append(1)
            return self._reply("Cache flushed.")
        out = json.loads(json.dumps(DOCUMENTED["outputs"][DOCUMENTED["prompts"].index(body["input_ids"])]))
        out["meta_info"]["cached_tokens"] = len(FLUSHES)
        self._reply(out)

    def _reply(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    address = (ARGV[ARGV.index("--host") + 1], int(ARGV[ARGV.index("--port") + 1]))
    ThreadingHTTPServer(address, Handler).serve_forever()
