"""A local stand-in for the Hugging Face Hub's file endpoints, for download tests.

huggingface_hub downloads a dataset file with `HEAD` then `GET` on
`{HF_ENDPOINT}/datasets/{owner}/{repo}/resolve/{revision}/{path}`, reading the commit
from `X-Repo-Commit`, the file's identity from `ETag` and its size from
`Content-Length`, and resuming a dropped transfer with a `Range` request. This server
answers exactly that (no Xet headers, so the plain HTTP path is used), plus the Hub's
error codes for a missing repository or file. Every request is recorded, and per-file
faults make it misbehave the way a real network does:

- "corrupt": serves bytes of the right length that are not the file;
- "short":   announces the full size but sends (and declares) only half the file;
- "drop":    the first GET sends half the file, then closes the connection.
"""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self) -> None:
        self.files: dict[str, dict[str, bytes]] = {}  # repo_id -> {path: content}
        self.faults: dict[str, str] = {}  # path -> fault name
        self.requests: list[tuple[str, str, str | None]] = []  # (method, file path, Range header)
        self._dropped: set[str] = set()
        self._server: ThreadingHTTPServer | None = None

    def add(self, repo_id: str, path: str, content: bytes) -> None:
        self.files.setdefault(repo_id, {})[path] = content

    def gets(self) -> list[str]:
        """Paths fetched with GET, in order."""
        return [path for method, path, _ in self.requests if method == "GET"]

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FakeHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _error(self, status: int, code: str) -> None:
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _serve(self, body: bool) -> None:
                parts = unquote(urlparse(self.path).path).strip("/").split("/")
                if len(parts) < 6 or parts[0] != "datasets" or parts[3] != "resolve":
                    return self._error(404, "EntryNotFound")
                repo_id, path = f"{parts[1]}/{parts[2]}", "/".join(parts[5:])
                hub.requests.append((self.command, path, self.headers.get("Range")))
                if repo_id not in hub.files:
                    return self._error(401, "RepoNotFound")
                if path not in hub.files[repo_id]:
                    return self._error(404, "EntryNotFound")
                content = hub.files[repo_id][path]
                fault = hub.faults.get(path)
                etag = hashlib.sha256(content).hexdigest()
                if fault == "corrupt":
                    content = bytes(255 - b for b in content)
                start = 0
                ranged = self.headers.get("Range", "")
                if body and ranged.startswith("bytes="):
                    start = int(ranged[len("bytes=") :].split("-")[0] or 0)
                payload = content[start:]
                declared = len(payload)
                if body and fault == "short":
                    payload = payload[: len(payload) // 2]
                    declared = len(payload)
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{etag}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(declared))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
                self.end_headers()
                if not body:
                    return
                if fault == "drop" and path not in hub._dropped:
                    hub._dropped.add(path)
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(payload)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
