"""`autoloop serve`: the command. It parses options, binds the socket, prints the link
with the token, and runs uvicorn; the rules are in `autoloop.serve.app`."""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from autoloop.errors import AutoloopError

DEFAULT_PORT = 8765
# `--nice`: the page as a guest on a machine whose cores the run keeps busy (a CPU-only box):
# the controller and its training runs then get a contended core first, and the page's
# answers wait. Not the default: on a GPU box the cores are mostly idle and a niced page
# only answers later (a seed's git checks run niced too).
DEFAULT_NICENESS = 0


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: treat it as the network


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (port 0: a free one), or one line saying why not."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    try:
        sock = socket.create_server((host.strip("[]"), port), family=family, backlog=64)
    except OSError as exc:
        if exc.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
            raise AutoloopError(f"port {port} on {host} is in use (another autoloop serve?): pick another with "
                                "--port") from None
        raise AutoloopError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): check --host and --port") from None
    sock.setblocking(False)
    return sock


def serve(
    repo: Annotated[Path, typer.Option("--repo", help="The git repository that holds train.py; the current folder by default.")] = Path("."),
    db: Annotated[Optional[str], typer.Option("--db", help="The trial database, relative to the repository; experiments.db by default.")] = None,
    host: Annotated[str, typer.Option(help="The address to listen on. 127.0.0.1 (this machine only) by default; any other address (e.g. 0.0.0.0) makes every request need the printed token.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="The port to listen on (0: any free one; the link printed says which).")] = DEFAULT_PORT,
    nice: Annotated[int, typer.Option(min=0, max=19, help="Lower the server's CPU priority by this much (Unix nice), so that a run that keeps every core busy gets them first; 0 keeps it.")] = DEFAULT_NICENESS,
):
    """Serve a live page of the runs in experiments.db: the headline, progress chart, running trials with their loss curves, the experiment tree, each trial, and steering (seed an idea, stop the run)."""
    try:
        import sse_starlette  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise AutoloopError("autoloop serve needs starlette, uvicorn and sse-starlette: pip install -e '.[serve]'") from None
    from autoloop.config import resolve
    from autoloop.serve.app import ServeState, create_app

    if nice and hasattr(os, "nice"):
        os.nice(nice)
    config = resolve(repo, {"db": db})
    db_path = Path(config.db) if Path(config.db).is_absolute() else Path(repo) / config.db
    public = not is_loopback(host)
    sock = bind(host, port)
    port = sock.getsockname()[1]
    token = secrets.token_urlsafe(24)
    state = ServeState(Path(repo), db_path.resolve(), db_option=db, token=token, public=public, port=port, host=host)
    shown = socket.gethostname() if host in ("0.0.0.0", "::") else host  # all interfaces: this machine's name
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    where = "exists" if db_path.exists() else "does not exist yet: the page shows it once a run starts"
    say = typer.echo
    say(f"autoloop serve: {db_path.resolve()} ({where}), read-only")
    if public:
        say(f"listening on {host}:{port}: every request needs the token. Open http://{shown}:{port}/?token={token}")
        say("plain HTTP: anyone on the network path can read the token; over an untrusted network use "
            "`ssh -L {0}:127.0.0.1:{0}` and serve on 127.0.0.1 instead".format(port))
    else:
        say(f"open http://{shown}:{port}/?token={token}")
        say("(the token lets that browser seed ideas and stop the run; without it the page only reads)")
    say("Ctrl-C stops the server (not the run)")
    sys.stdout.flush()
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning", access_log=False, lifespan="off",
                                           server_header=False, timeout_graceful_shutdown=2))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
