"""The `autoloop serve` application (Starlette): the page, its JSON, its live stream, and
two writes. Its security rules:

* **Where it listens.** 127.0.0.1 by default. On a loopback address, reading needs no
  token, but the `Host` header must name the loopback address and port (a DNS-rebinding
  page on another site cannot reach the server under its own name). On any other address
  (`--host 0.0.0.0`) **every** request needs the token, so the page is not world-readable
  on the network.
* **The token** is made at start-up (`secrets.token_urlsafe`), printed once in a link
  `http://host:port/?token=...`; opening that link puts it into an HttpOnly,
  SameSite=Strict cookie named for the port and redirects to the bare URL (the token
  leaves the address bar). A script sends it in an `X-Autoloop-Token` header instead.
  Compared in constant time.
* **Writes** (seeding an idea, asking the run to stop) need the token in every case, and
  refuse cross-site requests three ways: the cookie is SameSite=Strict, a request that
  authenticates with the cookie must also carry the custom `X-Autoloop-Request` header
  (a cross-site form cannot set a header, and a cross-site fetch that does needs a CORS
  preflight, which this server never grants), and an `Origin` header, when present, must
  be this server's own. The body must be JSON of at most `MAX_BODY` bytes.
* **What the page runs.** A strict Content-Security-Policy: scripts, styles and data
  only from this server (the vendored uPlot included; no CDN, no inline script or
  style), no frames, no form posts, and Trusted Types with no policy, so the browser
  refuses any `innerHTML`-style sink: the page builds every element with DOM calls and
  puts untrusted text (descriptions, reasons, diffs, logs, model output) in with
  `textContent` only. JSON replies carry `nosniff` and `Cross-Origin-Resource-Policy:
  same-origin`.
* **No secrets.** No environment and no config value that can hold a credential is
  served (`autoloop.serve.queries.SHOWN_CONFIG`).

Reads never block the controller (`autoloop.serve.readonly`): one read-only connection,
short queries, and every payload cached until `PRAGMA data_version` says another
connection committed. The live stream (server-sent events) checks that number and the
running trials' progress files twice a second and says "changed"; the page then fetches
what it shows, the run page in one request (`/api/runs/TAG/page`) that leaves out every
view whose fingerprint it already has. So an open page costs the controller nothing it
waits on, and one request's CPU a change.
"""

from __future__ import annotations

import gzip
import hashlib
import hmac
import json
import os
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from urllib.parse import parse_qs

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from autoloop.errors import AutoloopError, NotFound
from autoloop.serve import queries
from autoloop.serve.readonly import ReadOnlyStore

STATIC = Path(__file__).resolve().parent / "static"
MAX_BODY = 1_200_000  # a seeded patch is at most 1 MB (autoloop.proposers.seeding.MAX_PATCH_BYTES), plus its JSON
POLL_SECONDS = 0.5
MAX_STREAMS = 32
PING_SECONDS = 15
CACHE_ENTRIES = 256
CONTROLLER_CACHE_SECONDS = 5.0
GZIP_MIN_BYTES = 16 * 1024

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'; "
       "require-trusted-types-for 'script'; trusted-types 'none'")
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"permissions-policy", b"camera=(), microphone=(), geolocation=()"),
]


class ServeState:
    """What the app shares between requests: the read-only store, the payload cache."""

    def __init__(self, repo: Path, db_path: Path, *, db_option: str | None, token: str, public: bool,
                 port: int, host: str):
        self.repo = Path(repo).resolve()
        self.db_path = Path(db_path)
        self.db_option = db_option
        self.token = token
        self.public = public
        self.port = port
        self.host = host
        self.cookie = f"autoloop_token_{port}"
        self._store: ReadOnlyStore | None = None
        self._inode: tuple[int, int] | None = None
        self._lock = threading.RLock()  # one connection, one query at a time: each is short
        self._cache: OrderedDict = OrderedDict()
        self._watch: dict[str, tuple[int, list[Path]]] = {}  # run -> (data_version, its progress files)
        self._controller: tuple[float, dict | None] = (0.0, None)
        self._write_lock = threading.Lock()
        self.streams = 0

    # -- the store ------------------------------------------------------------------------

    def store(self) -> ReadOnlyStore | None:
        """The read-only store, opened when the db appears and again if it is replaced."""
        try:
            info = os.stat(self.db_path)
        except OSError:
            self._close()
            return None
        inode = (info.st_dev, info.st_ino)
        if self._store is None or inode != self._inode:
            self._close()
            self._store = ReadOnlyStore(self.db_path)
            self._inode = inode
        return self._store

    def _close(self) -> None:
        if self._store is not None:
            self._store.close()
        self._store, self._inode = None, None
        self._cache.clear()
        self._watch.clear()

    def version(self) -> int | None:
        store = self.store()
        return store.data_version() if store is not None else None

    def cached(self, key: tuple, compute, stamp=None):
        """`compute(store)` once per change of the db (or of `stamp`), under the lock."""
        with self._lock:
            store = self.store()
            if store is None:
                raise NoDatabase(self.db_path)
            version = (store.data_version(), stamp)
            hit = self._cache.get(key)
            if hit is not None and hit[0] == version:
                self._cache.move_to_end(key)
                return hit[1]
            value = compute(store)
            self._cache[key] = (version, value)
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return value

    def controller(self) -> dict | None:
        """Which controller holds the project's working tree (autoloop.loop.lock), re-read every few seconds."""
        at, info = self._controller
        if time.monotonic() - at > CONTROLLER_CACHE_SECONDS:
            from autoloop.loop.lock import holder

            try:
                held = holder(self.repo)
            except Exception:  # noqa: BLE001 - only a nicety on the page
                held = None
            info = {k: held.get(k) for k in ("pid", "tag", "since")} if held else None
            self._controller = (time.monotonic(), info)
        return info

    def stamp(self, tag: str | None) -> dict:
        """What the live stream compares: the db's data_version and the running trials'
        progress files (size, mtime), both cheap."""
        with self._lock:
            store = self.store()
            if store is None:
                return {"db": None, "live": None}
            version = store.data_version()
            watched = self._watch.get(tag or "")
            if watched is None or watched[0] != version:
                try:
                    run = queries.pick_run(store, tag)
                    paths = queries.running_progress_files(store, run, self.repo)
                except AutoloopError:
                    paths = []
                watched = (version, paths)
                self._watch[tag or ""] = watched
            live = [queries.stamp(p) for p in watched[1]]
        return {"db": version, "live": hash(tuple(live)) & 0xFFFFFFFF if live else 0}


class NoDatabase(Exception):
    def __init__(self, path: Path):
        super().__init__(f"no trial database at {path} yet: start a run with `autoloop run`; this page shows it "
                         "as soon as it exists")


# ---------------------------------------------------------------------------- the guard (ASGI middleware)


def _headers(scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def _cookies(header: str) -> dict[str, str]:
    out = {}
    for part in header.split(";"):
        name, sep, value = part.strip().partition("=")
        if sep:
            out[name] = value
    return out


class Guard:
    """Host check, token check, cross-site refusal and security headers (module docstring)."""

    def __init__(self, app, state: ServeState):
        self.app = app
        self.state = state
        loopback = ["127.0.0.1", "localhost", "[::1]"]
        self.hosts = None if state.public else {f"{h}:{state.port}" for h in loopback} | (
            set(loopback) if state.port == 80 else set())

    def _valid(self, candidate: str | None) -> bool:
        return bool(candidate) and hmac.compare_digest(candidate.encode(), self.state.token.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)

        async def secure_send(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        host = headers.get("host", "")
        if self.hosts is not None and host.lower() not in self.hosts:
            return await _deny(secure_send, 421, f"this server answers to 127.0.0.1:{self.state.port} only "
                                                 f"(got Host {host[:80]!r})")
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        by_header = self._valid(headers.get("x-autoloop-token"))
        by_cookie = self._valid(_cookies(headers.get("cookie", "")).get(self.state.cookie))
        by_query = self._valid((query.get("token") or [None])[0])
        authorized = by_header or by_cookie or by_query
        scope.setdefault("state", {})["auth"] = {"header": by_header, "cookie": by_cookie, "query": by_query}
        method = scope["method"]
        if method not in ("GET", "HEAD", "POST"):
            return await _deny(secure_send, 405, f"{method} is not served here")
        if self.state.public and not authorized:
            return await _deny(secure_send, 401, "this page needs its token: open the link `autoloop serve` printed "
                                                 "(it ends in ?token=...)")
        if method == "POST":
            if not (by_header or by_cookie):
                return await _deny(secure_send, 403, "steering needs the token: open the link `autoloop serve` "
                                                     "printed (it ends in ?token=...), then try again")
            if not by_header and headers.get("x-autoloop-request") != "1":
                return await _deny(secure_send, 403, "refused: a write must come from the page itself "
                                                     "(X-Autoloop-Request header missing)")
            origin = headers.get("origin")
            if origin is not None and origin.lower() not in (f"http://{host}".lower(), f"https://{host}".lower()):
                return await _deny(secure_send, 403, f"refused a cross-site request from {origin[:80]!r}")
            if headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
                return await _deny(secure_send, 415, "send the request body as JSON (Content-Type: application/json)")
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                length = MAX_BODY + 1
            if length > MAX_BODY:
                return await _deny(secure_send, 413, f"the request is {length} bytes and at most {MAX_BODY} are "
                                                     "accepted: a seeded patch is at most 1 MB")
            receive = _capped(receive, MAX_BODY)
        await self.app(scope, receive, secure_send)


def _capped(receive, limit: int):
    """A receive that stops a chunked body at `limit` bytes."""
    seen = [0]

    async def wrapped():
        message = await receive()
        if message["type"] == "http.request":
            seen[0] += len(message.get("body", b""))
            if seen[0] > limit:
                raise TooLarge()
        return message

    return wrapped


class TooLarge(Exception):
    pass


async def _deny(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------------------- routes


def encode(payload) -> str:
    """The JSON text the server sends for `payload`."""
    try:  # the common case, fast: nothing to clean
        return json.dumps(payload, allow_nan=False, separators=(",", ":"), default=str)
    except ValueError:  # a NaN or an infinity (JSON has neither): null instead
        return json.dumps(queries.clean(payload), allow_nan=False, separators=(",", ":"), default=str)


def fingerprint(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _json(payload, status: int = 200, request: Request | None = None) -> Response:
    return _json_text(encode(payload), status, request)


def _json_text(text: str, status: int = 200, request: Request | None = None) -> Response:
    body = text.encode()
    headers = {"cache-control": "no-store"}
    # The tree and the progress chart of 10,000 trials are a few hundred KB: a phone on
    # Wi-Fi gets them gzipped (no secret is in any reply, so compression leaks nothing).
    if request is not None and len(body) > GZIP_MIN_BYTES and "gzip" in request.headers.get("accept-encoding", ""):
        body = gzip.compress(body, compresslevel=5)
        headers.update({"content-encoding": "gzip", "vary": "Accept-Encoding"})
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _error(message: str, status: int = 400) -> Response:
    return _json({"error": message}, status)


def create_app(state: ServeState) -> Guard:
    """The ASGI application for `state` (wrapped in its Guard)."""

    def answer(compute_name: str, tag: str | None, compute, *, key_extra=(), stamp=None) -> tuple[str, str]:
        """(JSON text, its fingerprint) of one view, computed and encoded once per change."""
        def run_compute(store):
            text = encode(compute(store, queries.pick_run(store, tag)))
            return text, fingerprint(text)
        return state.cached((compute_name, tag, *key_extra), run_compute, stamp=stamp)

    def failed(exc: Exception) -> Response:
        if isinstance(exc, NoDatabase):
            return _error(str(exc), 503)
        return _error(str(exc), 404 if isinstance(exc, NotFound) else 400)

    def read(compute_name: str, request: Request, compute, *, key_extra=(), stamp=None) -> Response:
        try:
            text, _ = answer(compute_name, request.path_params.get("tag"), compute, key_extra=key_extra, stamp=stamp)
        except (NoDatabase, AutoloopError) as exc:
            return failed(exc)
        return _json_text(text, request=request)

    def index(request: Request):
        if request.scope["state"]["auth"]["query"]:
            # The token link: keep the token in a cookie and take it out of the address bar.
            response = RedirectResponse("/", status_code=303)
            response.set_cookie(state.cookie, state.token, httponly=True, samesite="strict", path="/")
            return response
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-store"})

    def session(request: Request):
        auth = request.scope["state"]["auth"]
        return _json({"can_write": bool(auth["cookie"] or auth["header"]), "public": state.public,
                      "db": str(state.db_path), "repo": str(state.repo), "poll_seconds": POLL_SECONDS})

    def runs(request: Request):
        try:
            value = state.cached(("runs",), queries.runs_list)
        except NoDatabase as exc:
            return _json({"runs": [], "missing": str(exc)})
        return _json({"runs": value})

    # The run page's views: (compute, key_extra, stamp) for a request.
    def summary_view(request: Request):
        return (lambda s, r: queries.summary(s, r, state.controller())), (), int(time.monotonic() // CONTROLLER_CACHE_SECONDS)

    def trials_view(request: Request):
        q = request.query_params
        try:
            offset, limit = int(q.get("offset", 0)), int(q.get("limit", queries.DEFAULT_PAGE))
        except ValueError:
            raise AutoloopError("offset and limit must be whole numbers") from None
        status, kind, parent = q.get("status") or None, q.get("kind") or None, q.get("parent") or None
        return (lambda s, r: queries.trials_page(s, r, offset=offset, limit=limit, status=status, kind=kind,
                                                 parent=parent)), (offset, limit, status, kind, parent), None

    def live_view(request: Request):
        return (lambda s, r: queries.live(s, r, state.repo)), (), state.stamp(request.path_params.get("tag"))["live"]

    run_page_views = {
        "summary": summary_view,
        "progress": lambda request: (queries.progress, (), None),
        "trials": trials_view,
        "live": live_view,
        "events": lambda request: (queries.events, (), None),
        "ideas": lambda request: (queries.ideas, (), None),
        "runs": lambda request: ((lambda s, r: queries.runs_list(s)), (), None),  # the run picker's list
    }

    def view(name: str):
        def endpoint(request: Request):
            try:
                compute, key_extra, stamp = run_page_views[name](request)
            except AutoloopError as exc:
                return _error(str(exc))
            return read(name, request, compute, key_extra=key_extra, stamp=stamp)
        return endpoint

    def page(request: Request):
        """Every view of the run page in one reply (or those `parts` names), each with its
        fingerprint; a view whose fingerprint the page already has (`have=name:fingerprint,...`)
        comes without its data. One request a change instead of one per view, and nothing
        re-encoded or re-sent that did not change."""
        tag = request.path_params.get("tag")
        wanted = [p for p in (request.query_params.get("parts") or ",".join(run_page_views)).split(",") if p]
        unknown = [p for p in wanted if p not in run_page_views]
        if unknown:
            return _error(f"unknown part '{unknown[0]}': the parts are {', '.join(run_page_views)}")
        have = dict(item.partition(":")[::2] for item in (request.query_params.get("have") or "").split(",") if item)
        out = []
        for name in wanted:
            try:
                compute, key_extra, stamp = run_page_views[name](request)
                text, digest = answer(name, tag, compute, key_extra=key_extra, stamp=stamp)
            except NoDatabase as exc:
                return failed(exc)
            except NotFound as exc:
                return failed(exc)  # the whole page's run: no part can answer
            except AutoloopError as exc:
                out.append(f'"{name}":' + encode({"error": str(exc)}))
                continue
            same = have.get(name) == digest
            out.append(f'"{name}":{{"hash":"{digest}"' + ("}" if same else f',"data":{text}}}'))
        return _json_text('{"parts":{' + ",".join(out) + "}}", request=request)

    def tree(request: Request):
        return read("tree", request, queries.tree)

    def trial(request: Request):
        try:
            number = int(request.path_params["number"])
        except ValueError:
            return _error("a trial number is a whole number, as `autoloop log` shows it")
        tag = request.path_params.get("tag")
        stamp = state.stamp(tag)["live"]
        return read("trial", request, lambda s, r: queries.trial_page(s, r, number, state.repo), key_extra=(number,),
                    stamp=stamp)

    async def stream(request: Request):
        from sse_starlette.sse import EventSourceResponse

        tag = request.query_params.get("run") or None
        if state.streams >= MAX_STREAMS:
            return _error(f"{MAX_STREAMS} pages are open already: close one", 503)

        async def changes():
            state.streams += 1
            try:
                last = None
                while True:
                    try:
                        now = await anyio.to_thread.run_sync(state.stamp, tag)
                    except Exception as exc:  # noqa: BLE001 - a db being replaced: say so, try again
                        now = {"db": None, "live": None, "error": str(exc)[:200]}
                    if now != last:
                        last = now
                        yield {"event": "change", "data": json.dumps(now)}
                    await anyio.sleep(POLL_SECONDS)
            finally:
                state.streams -= 1

        return EventSourceResponse(changes(), ping=PING_SECONDS, headers={"cache-control": "no-store"})

    async def body_of(request: Request) -> dict:
        try:
            raw = await request.body()
        except TooLarge:
            raise AutoloopError(f"the request is larger than {MAX_BODY} bytes: a seeded patch is at most 1 MB") from None
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            raise AutoloopError("the request body is not JSON") from None
        if not isinstance(data, dict):
            raise AutoloopError("the request body must be a JSON object")
        return data

    async def seed(request: Request):
        try:
            data = await body_of(request)
            return _json(await anyio.to_thread.run_sync(seed_from_page, state, data))
        except AutoloopError as exc:
            return _error(str(exc))

    async def stop(request: Request):
        tag = request.path_params["tag"]
        try:
            await body_of(request)
            return _json(await anyio.to_thread.run_sync(stop_from_page, state, tag))
        except AutoloopError as exc:
            return failed(exc)

    routes = [
        Route("/", index, methods=["GET", "HEAD"]),
        Route("/api/session", session),
        Route("/api/runs", runs),
        *[Route(f"/api/runs/{{tag}}/{name}", view(name)) for name in run_page_views if name != "runs"],
        Route("/api/runs/{tag}/page", page),
        Route("/api/runs/{tag}/trials/{number}", trial),
        Route("/api/runs/{tag}/tree", tree),
        Route("/api/runs/{tag}/stop", stop, methods=["POST"]),
        Route("/api/seed", seed, methods=["POST"]),
        Route("/api/stream", stream),
        Mount("/static", StaticFiles(directory=STATIC, follow_symlink=False), name="static"),
    ]
    return Guard(Starlette(routes=routes), state)


# ---------------------------------------------------------------------------- the two writes


def _text(data: dict, name: str, *, required: bool = False) -> str | None:
    value = data.get(name)
    if value is None or value == "":
        if required:
            raise AutoloopError(f"the request needs '{name}'")
        return None
    if not isinstance(value, str):
        raise AutoloopError(f"'{name}' must be text")
    return value


def seed_from_page(state: ServeState, data: dict) -> dict:
    """`autoloop seed` from the page: the same resolver, the same `seed_idea` with the same
    checks, the same one-line errors; a patch arrives as text and is handed over as the
    file the CLI would read."""
    from autoloop.config import resolve
    from autoloop.proposers.seeding import seed_idea

    description = _text(data, "description") or ""
    sets = data.get("sets") or []
    if isinstance(sets, str):
        sets = [line for line in sets.splitlines() if line.strip()]
    if not isinstance(sets, list) or not all(isinstance(s, str) for s in sets):
        raise AutoloopError("'sets' must be a list of NAME=VALUE texts, as --set takes them")
    priority = data.get("priority", 0)
    if isinstance(priority, str) and priority.strip().lstrip("-").isdigit():
        priority = int(priority)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise AutoloopError("--priority must be a whole number")
    tag = _text(data, "tag")
    patch_text = _text(data, "patch")
    config = resolve(state.repo, {"db": state.db_option})
    with state._write_lock, tempfile.TemporaryDirectory(prefix="autoloop-seed-") as tmp:
        patch = None
        if patch_text is not None:
            patch = Path(tmp) / "idea.patch"
            patch.write_text(patch_text, encoding="utf-8")
        try:
            idea = seed_idea(config, state.repo, description, sets=[s.strip() for s in sets], patch=patch,
                             priority=priority, tag=tag)
        except AutoloopError as exc:
            raise AutoloopError(str(exc).replace(str(patch), "the patch") if patch else str(exc)) from None
    return {"id": idea["id"], "message": f"seeded idea {idea['id']}: {description}"}


def stop_from_page(state: ServeState, tag: str) -> dict:
    """`autoloop stop` from the page: the same `pick_run` and `Store.request_stop`."""
    from autoloop.review.queries import pick_run
    from autoloop.store import Store

    if not state.db_path.exists():
        raise AutoloopError(f"no trial database at {state.db_path}: start a run with `autoloop run`, or point --db at one")
    with state._write_lock, Store(state.db_path) as store:
        run = pick_run(store, tag)
        store.request_stop(run["tag"])
    return {"message": f"asked run '{run['tag']}' to stop after its current trial"}
