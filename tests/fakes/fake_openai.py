"""A fake OpenAI-compatible chat server: a real HTTP server on loopback, scripted answers.

`FakeOpenAI(script)` serves POST /v1/chat/completions. Each request takes the next item
of the script (the last one repeats when the script runs out):

* a string: the assistant's answer, with usage (prompt tokens = request bytes // 4,
  completion tokens = answer bytes // 4, so tests can check cost arithmetic);
* `Error(status)`: that HTTP status with an OpenAI-style error body;
* `Slow(seconds, item)`: wait, then answer with `item` (a client with a shorter timeout
  gives up first);
* a callable: called with the request's JSON body, returns one of the above.

GET /v1/models lists `models` (default: the one model), or answers `Error(status)` when
`models` is one; the listings asked for are counted in `listings`. `port` binds a given
port: a server stopped and started again on the same port is a model server that went
down and came back.

Every request's JSON body is kept in `requests` and its headers (lower-cased names) in
`headers`, for assertions.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Error:
    status: int
    message: str = "scripted failure"


@dataclass
class Slow:
    seconds: float
    item: object


class FakeOpenAI:
    def __init__(self, script=None, model: str = "fake-model", models=None, port: int = 0):
        self.script = list(script or [])
        self.model = model
        self.models = [model] if models is None else models
        self.listings = 0
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self._lock = threading.Lock()
        self._served = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):
                if not self.path.rstrip("/").endswith("/models"):
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                with fake._lock:
                    fake.listings += 1
                if isinstance(fake.models, Error):
                    self._send(fake.models.status, {"error": {"message": fake.models.message, "type": "server_error"}})
                    return
                self._send(200, {"object": "list", "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "fake"} for name in fake.models]})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                body = json.loads(raw or b"{}")
                with fake._lock:
                    fake.requests.append(body)
                    fake.headers.append({k.lower(): v for k, v in self.headers.items()})
                    item = fake._next()
                try:
                    item = item(body) if callable(item) else item
                    while isinstance(item, Slow):
                        time.sleep(item.seconds)
                        item = item.item(body) if callable(item.item) else item.item
                except Exception as exc:  # a broken script answers 500, visibly
                    item = Error(500, f"the fake server's script failed: {exc!r}")
                if isinstance(item, Error):
                    self._send(item.status, {"error": {"message": item.message, "type": "server_error"}})
                    return
                answer = str(item)
                self._send(200, {
                    "id": f"chatcmpl-{len(fake.requests)}", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model", fake.model),
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": answer}}],
                    "usage": {"prompt_tokens": len(raw) // 4, "completion_tokens": len(answer.encode()) // 4,
                              "total_tokens": len(raw) // 4 + len(answer.encode()) // 4},
                })

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _next(self):
        if not self.script:
            raise AssertionError("the fake server was called but has no script")
        item = self.script[min(self._served, len(self.script) - 1)]
        self._served += 1
        return item

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> "FakeOpenAI":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def edit_answer(search: str, replace: str, description: str = "change a constant", path: str = "train.py",
                prose: bool = True) -> str:
    """An answer in the format program.md asks for, wrapped in the prose and fences models add."""
    intro = "Sure! Here is my proposal.\n\n" if prose else ""
    return (
        f"{intro}DESCRIPTION: {description}\n\n"
        f"```python\nFILE: {path}\n<<<<<<< SEARCH\n{search}\n=======\n{replace}\n>>>>>>> REPLACE\n```\n"
        + ("\nThis should help because reasons.\n" if prose else "")
    )
