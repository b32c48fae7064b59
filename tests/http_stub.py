"""Local stub HTTP servers of the backend tests: a quiet handler base with the reply every stub
writes, and a server on a free loopback port that answers from a thread.

    class Stub(StubHandler):
        def do_GET(self):
            self.reply({"version": "stub"})

    httpd = serve(Stub)  # httpd.url; stop with httpd.shutdown()
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StubHandler(BaseHTTPRequestHandler):
    """A request handler that writes no log lines and answers with `reply`."""

    def read_json(self) -> Any:
        """The request's JSON body."""
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def reply(self, obj: Any, status: int = 200) -> None:
        """Answer `status` with `obj` as the whole body: a str as text/plain, bytes as they are under a
        JSON content type (a body that claims JSON and is not), anything else as JSON."""
        if isinstance(obj, bytes):
            data, kind = obj, "application/json"
        elif isinstance(obj, str):
            data, kind = obj.encode(), "text/plain"
        else:
            data, kind = json.dumps(obj).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def serve(handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """A threading server of `handler` on a free 127.0.0.1 port, answering from a daemon thread;
    `url` is its base URL. The caller stops it with `shutdown()`."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"  # type: ignore[attr-defined]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd
