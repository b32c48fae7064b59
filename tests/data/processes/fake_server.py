"""A stand-in server for tests/test_guard.py: `fake_server.py PORT MODE [--temp-file]`.

MODE "healthy" answers GET /health with 200 after a second; "silent" never answers 200; "crash"
exits with code 3 after printing a line. It starts a child process in its group, as vLLM's server
starts its EngineCore; with --temp-file it leaves a file in its temporary folder, as SGLang leaves its
sockets, and prints the file's path.
"""

import subprocess
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.server.mode == "healthy" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    port, mode = int(sys.argv[1]), sys.argv[2]
    print(f"fake server starting in mode {mode}", flush=True)
    if mode == "crash":
        sys.exit(3)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if "--temp-file" in sys.argv[3:]:
        print("temp file", tempfile.mkstemp(prefix="fake-server-socket-")[1], flush=True)
    time.sleep(1)
    httpd = HTTPServer(("127.0.0.1", port), Health)
    httpd.mode = mode
    httpd.serve_forever()
