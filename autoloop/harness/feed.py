"""The harness's data feed: training batches served by a trusted process that counts them.

Under the controller a training process never opens the split files (its data folder is
a meta-only view, see data.make_meta_only_view). `TokenLoader(ds, "train", ...)` gets its
batches from a FeedServer instead: a thread in the controller process, on a unix socket
in the trial's run folder (AUTOLOOP_FEED names it). The server samples with the loader's
own WindowSampler from the same memory map, so the batches are the same, bit for bit,
with or without the feed. It counts batches and tokens and timestamps every request and
every clock tick with the controller's clock (time.monotonic), which the trial's code
does not control; autoloop.trust.budget.check_budget judges the trial from that record.
A request for another split (val, heldout) is refused and recorded.

Protocol. Every message is a frame: a 5-byte header (payload length: uint32 big-endian,
kind: uint8) and the payload. Client -> server:

    HELLO  JSON {split, batch_size, seq_len, seed, sequential, device, pid}
           -> OK JSON {stream, dtype, format}, or ERROR (utf-8 reason): opens a stream
    NEXT   uint32 stream id -> BATCH: batch_size x (seq_len + 1) tokens in `dtype`, C order
    TICK   uint64 steps so far (TrainingClock.step_finished); no reply, so no round trip
    BYE    no reply; the server closes the connection

One connection per training process (shared by its loaders and its clock) and one
handler thread per connection. After answering NEXT the handler computes the stream's
next batch while the trial trains, so a request is answered with a send. A request is
timed when its header arrives.

Unix socket paths are limited to ~107 bytes: a longer address is reached on Linux
through /proc/self/fd/N/<name> (N an O_PATH descriptor of its folder), so the socket
stays in the run folder (which the sandbox binds); elsewhere the server falls back to a
private temporary folder and reports its real `address`.

Memory. The feed runs in the controller, so what a trial asks of it is the controller's
memory: a batch is drawn as one array (a gather from a strided view of the memory map,
no Python object per window), and every stream holds at most two batches (the one being
sent and the next, drawn ahead). Each stream's two batches and their window starts are
reserved against `memory_budget` (DEFAULT_MEMORY_BUDGET, all streams and connections of
the trial together) when it opens; a hello over what is left is refused, recorded in
the summary (`over_budget`), and the trial is invalid with the budget named. The default,
256 MiB, is ~250 x the largest honest batch train.py asks for on a GPU (64 x 2049 tokens
of uint16 or uint32: 0.25-0.5 MiB, two of them per stream, a few streams).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from autoloop.harness.constants import UNTIMED_WARMUP_STEPS
from autoloop.harness.data import ENV_FEED, WindowSampler, check_window_fits, load_dataset, read_windows, split_refusal
from autoloop.harness.errors import HarnessError
from autoloop.harness.proctree import tree_cpu_seconds

FORMAT = 1

_HEADER = struct.Struct(">IB")
_TICK = struct.Struct(">IBQ")  # a whole TICK frame: header + steps
_STREAM_ID = struct.Struct(">I")
HELLO, NEXT, TICK, BYE = 1, 2, 3, 4
OK, BATCH, ERROR = 0x81, 0x82, 0x83

MAX_REQUEST_BYTES = 64 * 2**10  # a HELLO is ~150 bytes
MAX_BATCH_TOKENS = 2**26  # per batch, whatever the budget: a window count no honest loader asks for
DEFAULT_MEMORY_BUDGET = 256 * 2**20  # bytes the feed may hold for one trial (see the module doc); feed_memory_mb
HELD_BATCHES = 2  # per stream: the batch being sent and the next one, drawn ahead
_START_BYTES = 24  # per window: its int64 start and the sampler's int64 temporaries
MAX_CONNECTIONS = 8  # at once, per server
MAX_STREAMS = 64
MAX_RECORDED_TICKS = 200_000  # tick times kept one by one (a 300 s GPU trial ticks ~1-5k times)
MAX_RECORDED_EVENTS = 50  # refusals and protocol errors kept (all are counted)
_SUN_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes on Linux, 104 on macOS


def _round(t: float | None) -> float | None:
    return None if t is None else round(t, 6)


@contextmanager
def _reachable(address: Path) -> Iterator[str | None]:
    """A path by which bind/connect reach `address`, or None when the platform has none."""
    raw = os.fsencode(address)
    if len(raw) <= _SUN_PATH_MAX:
        yield str(address)
        return
    if not sys.platform.startswith("linux") or len(os.fsencode(address.name)) > 64:
        yield None
        return
    try:
        fd = os.open(address.parent, os.O_PATH)
    except OSError as exc:
        raise HarnessError(f"cannot open the folder of the data feed's socket {address.parent} ({exc.strerror})") from None
    try:
        yield f"/proc/self/fd/{fd}/{address.name}"
    finally:
        os.close(fd)


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    """Exactly n bytes, or None when the peer closed the connection before the first byte."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def _peer_pid(conn: socket.socket) -> int | None:
    """The connecting process's pid in our namespace (the kernel translates it from the
    trial's PID namespace), or None where SO_PEERCRED does not exist."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (AttributeError, OSError):
        return None
    pid = struct.unpack("3i", raw)[0]
    return pid if pid > 0 else None


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int | None) -> float | None:
    """CPU seconds the process has used, its reaped children included (/proc/<pid>/stat
    utime + stime + cutime + cstime), read by the feed itself: the trial cannot fake it.
    This is what tells a step slowed down by a busy machine (wall time up, CPU time not)
    from a step that did more work (both up); see autoloop.trust.budget."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rpartition(b")")[2].split()
        return sum(int(f) for f in fields[11:15]) / _CLOCK_TICKS
    except (OSError, ValueError, IndexError):
        return None


def _frame(kind: int, payload: bytes = b"") -> bytes:
    return _HEADER.pack(len(payload), kind) + payload


# ---------------------------------------------------------------------------- server


def stream_bytes(batch_size: int, seq_len: int, itemsize: int) -> int:
    """What one stream may hold in the feed's process: HELD_BATCHES batches of windows and their starts."""
    return HELD_BATCHES * batch_size * ((seq_len + 1) * itemsize + _START_BYTES)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**20:.2f} MiB"


class _Stream:
    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, sequential: bool, record: dict,
                 reserved: int = 0):
        self.tokens, self.seq_len = tokens, seq_len
        self.reserved = reserved
        self.sampler = WindowSampler(len(tokens), batch_size, seq_len, seed=seed, sequential=sequential)
        self.tokens_per_batch = batch_size * seq_len
        self.record = record
        self.pending: np.ndarray | None = None

    def take(self) -> np.ndarray:
        windows = self.pending if self.pending is not None else self.draw()
        self.pending = None
        return windows

    def draw(self) -> np.ndarray:
        return read_windows(self.tokens, self.sampler.starts(), self.seq_len)  # a new C-ordered array


class FeedServer:
    """Serves the TRAIN split of `data_dir` over a unix socket at `address`; see the module doc.

        with FeedServer(data_dir, run_dir / "feed.sock", seed=seed) as feed:
            feed.mark_spawn(); ... run the trial with AUTOLOOP_FEED=str(feed.address) ...
            feed.mark_exit()
        summary = feed.summary()

    `seed` is the seed the controller gave the trial: streams that ask for another one are
    served (the trial's own choice of data order) and listed in the summary.
    `memory_budget`: the bytes all the trial's streams may hold together (module doc).
    """

    def __init__(self, data_dir: Path | str, address: Path | str, *, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic, memory_budget: int = DEFAULT_MEMORY_BUDGET):
        if memory_budget < 1:
            raise HarnessError(f"the data feed's memory budget is {memory_budget} bytes: give it at least one batch's")
        self.data_dir = Path(data_dir)
        self.requested_address = Path(address)
        self.address = self.requested_address
        self.seed = seed
        self.memory_budget = int(memory_budget)
        self._held = 0  # bytes reserved by the open streams (stream_bytes), under the lock
        self._held_peak = 0
        self._over_budget: dict | None = None  # the first hello refused for the budget
        self._over_budget_count = 0
        ds = load_dataset(self.data_dir, prepare=False)
        if ds.withheld:
            raise HarnessError(f"{self.data_dir} is a meta-only view of a dataset: give the data feed the prepared dataset itself")
        self._tokens = ds._memmap("train")
        self.dtype = self._tokens.dtype
        self.dataset_fingerprint = ds.fingerprint
        self._clock = clock
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._tmpdir: Path | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._t0: float | None = None
        # what the summary reports (offsets in seconds from start())
        self._spawned = self._exited = self._closed = None
        self._connections = 0
        self._first_connect = self._last_disconnect = None
        self._streams: list[dict] = []
        self._batches = self._tokens_served = 0
        self._first_request = self._first_batch = self._last_batch = None
        self._ticks = 0
        self._tick_times: list[float] = []
        self._tick_batches: list[int] = []
        self._tick_cpu: list[float | None] = []  # the ticking process's CPU seconds, read by us at each tick
        self._last_ticks: deque = deque(maxlen=3)
        self._last_tick_steps = None
        self._refused: list[dict] = []
        self._refused_count = 0
        self._errors: list[str] = []
        self._error_count = 0
        self._checkpoint_first = self._checkpoint_last = None
        self._checkpoint_bytes = 0
        self._peers: set[int] = set()  # pids of the connected processes (SO_PEERCRED)
        self._cpu_sample: float | None = None
        # The spawned process (mark_spawn) and its whole tree's CPU seconds at the first batch
        # and at each warm-up tick: the start-up rule's figures (autoloop.trust.startup).
        self._root: int | None = None
        self._first_batch_cpu: float | None = None
        self._warmup_cpu: list[float | None] = []

    # ---- life cycle

    def start(self) -> "FeedServer":
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.address = self._bind(listener)
            listener.listen(MAX_CONNECTIONS)
            listener.settimeout(0.2)  # the accept loop looks at the stop flag this often
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._t0 = self._clock()
        thread = threading.Thread(target=self._accept_loop, name="autoloop-feed", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def _bind(self, listener: socket.socket) -> Path:
        address = self.requested_address
        try:
            address.parent.mkdir(parents=True, exist_ok=True)
            if address.is_socket():
                address.unlink()  # left by a controller that died
        except OSError as exc:
            raise HarnessError(f"cannot create the data feed's socket at {address} ({exc.strerror}): check the run folder") from None
        with _reachable(address) as path:
            if path is not None:
                try:
                    listener.bind(path)
                    return address
                except OSError as exc:
                    raise HarnessError(f"cannot bind the data feed's socket at {address} ({exc.strerror})") from None
        self._tmpdir = Path(tempfile.mkdtemp(prefix="alfeed-"))
        fallback = self._tmpdir / "feed.sock"
        listener.bind(str(fallback))
        return fallback

    def close(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        with self._lock:
            self._closed = self._offset(self._clock())
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
        try:
            if self.address.is_socket():
                self.address.unlink()
        except OSError:
            pass
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> "FeedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def mark_spawn(self, at: float | None = None, pid: int | None = None) -> None:
        """Record when the training process was started (time.monotonic(); now by default)
        and its pid, the root of the tree whose CPU time the start-up rule reads."""
        with self._lock:
            self._spawned = self._offset(self._clock() if at is None else at)
            self._root = pid

    def mark_exit(self, at: float | None = None) -> None:
        """Record when the training process ended (time.monotonic(); now by default)."""
        with self._lock:
            self._exited = self._offset(self._clock() if at is None else at)

    def sample_cpu(self) -> None:
        """Read the CPU time of the processes that connected (the training), now: called
        several times a second while the run lives, so the last sample is the CPU it had
        used when it exited, give or take one interval (the budget's tail rule)."""
        with self._lock:
            peers = list(self._peers)
        total = None
        for pid in peers:
            cpu = _cpu_seconds(pid)
            if cpu is not None:
                total = (total or 0.0) + cpu
        if total is not None:
            with self._lock:
                self._cpu_sample = max(total, self._cpu_sample or 0.0)

    def mark_checkpoint(self, size: int, at: float | None = None) -> None:
        """Record that the run's checkpoint file appeared or changed (seen from outside the
        trial, by the controller's side watching the run's output folder) and its size now."""
        with self._lock:
            now = self._offset(self._clock() if at is None else at)
            if self._checkpoint_first is None:
                self._checkpoint_first = now
            self._checkpoint_last, self._checkpoint_bytes = now, int(size)

    def _offset(self, t: float) -> float:
        return t - self._t0 if self._t0 is not None else 0.0

    # ---- serving

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.05)
                continue
            conn.settimeout(None)
            now = self._offset(self._clock())
            with self._lock:
                if len(self._conns) >= MAX_CONNECTIONS:
                    self._error(f"{now:.3f}: connection refused, {MAX_CONNECTIONS} already open")
                    conn.close()
                    continue
                self._conns.add(conn)
                self._connections += 1
                if self._first_connect is None:
                    self._first_connect = now
            thread = threading.Thread(target=self._serve, args=(conn, _peer_pid(conn)), name="autoloop-feed-conn",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def _error(self, text: str) -> None:  # called with the lock held
        self._error_count += 1
        if len(self._errors) < MAX_RECORDED_EVENTS:
            self._errors.append(text)

    def _serve(self, conn: socket.socket, peer: int | None = None) -> None:
        if peer is not None:
            with self._lock:
                self._peers.add(peer)
        self._serve_requests(conn, peer)

    def _serve_requests(self, conn: socket.socket, peer: int | None) -> None:
        streams: dict[int, _Stream] = {}
        try:
            while not self._stopping.is_set():
                header = _recv_exact(conn, _HEADER.size)
                if header is None:
                    break
                now = self._offset(self._clock())
                length, kind = _HEADER.unpack(header)
                if length > MAX_REQUEST_BYTES:
                    with self._lock:
                        self._error(f"{now:.3f}: request of {length} bytes (kind {kind}), connection closed")
                    break
                payload = bytes(_recv_exact(conn, length) or b"") if length else b""
                if kind == NEXT:
                    self._next(conn, streams, payload, now)
                elif kind == TICK and len(payload) == 8:
                    # The tree is read at the warm-up ticks only: a walk of /proc costs milliseconds.
                    tree = tree_cpu_seconds(self._root) if self._ticks < UNTIMED_WARMUP_STEPS else None
                    self._tick(struct.unpack(">Q", payload)[0], now, _cpu_seconds(peer), tree)
                elif kind == HELLO:
                    self._hello(conn, streams, payload, now)
                elif kind == BYE:
                    break
                else:
                    with self._lock:
                        self._error(f"{now:.3f}: unknown request kind {kind} ({length} bytes), connection closed")
                    break
        except (OSError, ConnectionError) as exc:
            if not self._stopping.is_set():
                with self._lock:
                    self._error(f"connection lost: {exc}")
        finally:
            # The streams' bytes go back in the same step as the connection: whoever sees it
            # closed may open a stream in its share at once.
            with self._lock:
                self._conns.discard(conn)
                self._held -= sum(stream.reserved for stream in streams.values())
                self._last_disconnect = self._offset(self._clock())
            streams.clear()
            conn.close()

    def _hello(self, conn: socket.socket, streams: dict, payload: bytes, now: float) -> None:
        try:
            hello = json.loads(payload)
            split = str(hello["split"])
            batch_size, seq_len = int(hello["batch_size"]), int(hello["seq_len"])
            seed, sequential = int(hello.get("seed", 0)), bool(hello.get("sequential", False))
        except (ValueError, KeyError, TypeError) as exc:
            conn.sendall(_frame(ERROR, f"malformed hello to the data feed: {exc}".encode()))
            return
        with self._lock:
            if self._first_request is None:
                self._first_request = now
            if split != "train":
                self._refused_count += 1
                if len(self._refused) < MAX_RECORDED_EVENTS:
                    self._refused.append({"time": _round(now), "split": split[:40], "pid": hello.get("pid")})
                refusal = split_refusal(split)
            elif batch_size < 1 or seq_len < 1 or batch_size * (seq_len + 1) > MAX_BATCH_TOKENS:
                refusal = f"a batch of {batch_size} x {seq_len + 1} tokens is outside what the data feed serves"
            elif len(self._streams) >= MAX_STREAMS:
                refusal = f"the data feed serves at most {MAX_STREAMS} loaders per trial"
            else:
                refusal = self._reserve(batch_size, seq_len, now)
        reserved = stream_bytes(batch_size, seq_len, self.dtype.itemsize) if refusal is None else 0
        if refusal is None:
            try:
                check_window_fits(len(self._tokens), seq_len, split, self.data_dir)
            except HarnessError as exc:
                refusal = str(exc)
                with self._lock:
                    self._held -= reserved
        if refusal is not None:
            conn.sendall(_frame(ERROR, refusal.encode()))
            return
        record = {"opened": _round(now), "split": split, "batch_size": batch_size, "seq_len": seq_len, "seed": seed,
                  "sequential": sequential, "device": str(hello.get("device", ""))[:20], "pid": hello.get("pid"),
                  "batches": 0, "tokens": 0}
        stream = _Stream(self._tokens, batch_size, seq_len, seed, sequential, record, reserved)
        with self._lock:
            self._streams.append(record)
        stream_id = len(streams)
        streams[stream_id] = stream
        reply = {"stream": stream_id, "dtype": self.dtype.name, "format": FORMAT}
        conn.sendall(_frame(OK, json.dumps(reply).encode()))
        stream.pending = stream.draw()

    def _reserve(self, batch_size: int, seq_len: int, now: float) -> str | None:
        """Reserve a new stream's bytes against the budget (the lock held); the refusal when over it."""
        need = stream_bytes(batch_size, seq_len, self.dtype.itemsize)
        if self._held + need <= self.memory_budget:
            self._held += need
            self._held_peak = max(self._held_peak, self._held)
            return None
        self._over_budget_count += 1
        held = f"{_mib(self._held)} already held" if self._held else "nothing else held"
        refusal = (f"asked the data feed for batches of {batch_size} x {seq_len + 1} tokens, {_mib(need)} with the "
                   f"batch in flight and the next ({held}): past the feed's "
                   f"{_mib(self.memory_budget)} budget for a trial (raise feed-memory-mb if an honest batch needs it)")
        if self._over_budget is None:
            self._over_budget = {"time": _round(now), "batch_size": batch_size, "seq_len": seq_len, "bytes": need,
                                 "held": self._held, "reason": refusal}
        return refusal

    def _next(self, conn: socket.socket, streams: dict, payload: bytes, now: float) -> None:
        stream = streams.get(_STREAM_ID.unpack(payload)[0]) if len(payload) == _STREAM_ID.size else None
        if stream is None:
            conn.sendall(_frame(ERROR, b"no such stream: send a hello first"))
            return
        windows = stream.take()
        # Before the first batch is sent: what the tree used until then is its start-up.
        tree = tree_cpu_seconds(self._root) if self._first_batch is None else None
        with self._lock:  # before the send: once the trial has the batch, the record has it
            self._batches += 1
            self._tokens_served += stream.tokens_per_batch
            stream.record["batches"] += 1
            stream.record["tokens"] += stream.tokens_per_batch
            if self._first_batch is None:
                self._first_batch, self._first_batch_cpu = now, tree
            if self._first_request is None:
                self._first_request = now
            self._last_batch = now
        data = memoryview(windows).cast("B")
        conn.sendall(_HEADER.pack(len(data), BATCH))
        conn.sendall(data)
        stream.pending = stream.draw()  # while the trial trains on this one

    def _tick(self, steps: int, now: float, cpu: float | None = None, tree: float | None = None) -> None:
        with self._lock:
            if self._ticks < UNTIMED_WARMUP_STEPS:
                self._warmup_cpu.append(tree)
            self._ticks += 1
            self._last_tick_steps = steps
            if len(self._tick_times) < MAX_RECORDED_TICKS:
                self._tick_times.append(_round(now))
                self._tick_batches.append(self._batches)
                self._tick_cpu.append(cpu)
            self._last_ticks.append([_round(now), self._batches, cpu])

    # ---- the record

    def summary(self) -> dict:
        """What the feed saw, JSON-able; times are seconds since start() on the controller's clock.

        tick_times[k] / tick_batches[k]: when the (k+1)-th clock tick arrived and how many
        batches had been served by then (the first MAX_RECORDED_TICKS ticks; last_ticks
        always holds the last three). first_request: the trial's first hello or batch.
        first_batch_tree_cpu / warmup_tree_cpu[k]: CPU seconds of the spawned process's whole
        tree at the first batch and at the (k+1)-th of the first UNTIMED_WARMUP_STEPS ticks.
        """
        with self._lock:
            seeds = sorted({s["seed"] for s in self._streams if s["split"] == "train"})
            return {
                "format": FORMAT,
                "address": str(self.address),
                "dataset": self.dataset_fingerprint,
                "started_at": self._t0,
                "spawned": _round(self._spawned),
                "exited": _round(self._exited),
                "closed": _round(self._closed),
                "connections": self._connections,
                "first_connect": _round(self._first_connect),
                "last_disconnect": _round(self._last_disconnect),
                "streams": [dict(s) for s in self._streams],
                "seed": self.seed,
                "foreign_seeds": [s for s in seeds if self.seed is not None and s != self.seed],
                "batches": self._batches,
                "tokens": self._tokens_served,
                "first_request": _round(self._first_request),
                "first_batch": _round(self._first_batch),
                "last_batch": _round(self._last_batch),
                "ticks": self._ticks,
                "last_tick_steps": self._last_tick_steps,
                "tick_times": list(self._tick_times),
                "tick_batches": list(self._tick_batches),
                "tick_cpu": list(self._tick_cpu),
                "cpu_sample": _round(self._cpu_sample),
                "root_pid": self._root,
                "first_batch_tree_cpu": _round(self._first_batch_cpu),
                "warmup_tree_cpu": [_round(c) for c in self._warmup_cpu],
                "last_ticks": [list(t) for t in self._last_ticks],
                "refused": [dict(r) for r in self._refused],
                "refused_count": self._refused_count,
                "memory_budget": self.memory_budget,
                "memory_peak": self._held_peak,
                "over_budget": dict(self._over_budget) if self._over_budget is not None else None,
                "over_budget_count": self._over_budget_count,
                "errors": list(self._errors),
                "error_count": self._error_count,
                "checkpoint": {"first_seen": _round(self._checkpoint_first), "last_change": _round(self._checkpoint_last),
                               "bytes": self._checkpoint_bytes} if self._checkpoint_last is not None else None,
            }


# ---------------------------------------------------------------------------- client


class FeedStream:
    """One loader's batches from the feed."""

    def __init__(self, client: "FeedClient", stream_id: int, batch_size: int, seq_len: int, dtype: np.dtype):
        self.client, self.stream_id = client, stream_id
        self.shape = (batch_size, seq_len + 1)
        self.dtype = dtype
        self._request = _frame(NEXT, _STREAM_ID.pack(stream_id))
        self._nbytes = batch_size * (seq_len + 1) * dtype.itemsize

    def next_windows(self) -> np.ndarray:
        kind, data = self.client.request(self._request)
        if kind != BATCH or len(data) != self._nbytes:
            raise self.client.failure(data, kind)
        return np.frombuffer(data, dtype=self.dtype).reshape(self.shape)


class FeedClient:
    """A training process's connection to the feed (one per process; see feed_client)."""

    def __init__(self, address: str):
        self.address = address
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with _reachable(Path(address)) as path:
                if path is None:
                    raise OSError(36, "the socket path is too long for this platform")
                self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise HarnessError(
                f"cannot reach the harness's data feed at {address} ({exc.strerror or exc}): the controller serves it "
                f"while it runs a trial; unset {ENV_FEED} to read the data files directly"
            ) from None

    def _lost(self, exc: BaseException) -> HarnessError:
        return HarnessError(f"lost the connection to the harness's data feed at {self.address} ({exc}): "
                            "the controller stopped serving this trial")

    def request(self, frame: bytes) -> tuple[int, bytearray]:
        with self._lock:
            try:
                self._sock.sendall(frame)
                header = _recv_exact(self._sock, _HEADER.size)
                if header is None:
                    raise ConnectionError("closed by the controller")
                length, kind = _HEADER.unpack(header)
                data = _recv_exact(self._sock, length) if length else bytearray()
            except (OSError, ConnectionError) as exc:
                raise self._lost(exc) from None
        return kind, data

    def failure(self, data: bytes, kind: int) -> HarnessError:
        if kind == ERROR:
            return HarnessError(bytes(data).decode(errors="replace"))
        return HarnessError(f"the harness's data feed at {self.address} answered with an unexpected message (kind {kind})")

    def open_stream(self, split: str, batch_size: int, seq_len: int, *, seed: int = 0, sequential: bool = False,
                    device_type: str = "cpu") -> FeedStream:
        hello = {"split": split, "batch_size": int(batch_size), "seq_len": int(seq_len), "seed": int(seed),
                 "sequential": bool(sequential), "device": device_type, "pid": os.getpid()}
        kind, data = self.request(_frame(HELLO, json.dumps(hello).encode()))
        if kind != OK:
            raise self.failure(data, kind)
        reply = json.loads(bytes(data))
        return FeedStream(self, int(reply["stream"]), batch_size, seq_len, np.dtype(reply["dtype"]))

    def tick(self, steps: int) -> None:
        """Tell the feed a training step finished (no reply: costs one small send)."""
        with self._lock:
            try:
                self._sock.sendall(_TICK.pack(8, TICK, steps))
            except OSError as exc:
                raise self._lost(exc) from None

    def close(self) -> None:
        with self._lock:
            try:
                self._sock.sendall(_frame(BYE))
            except OSError:
                pass
            self._sock.close()


_client: FeedClient | None = None
_client_lock = threading.Lock()


def feed_client() -> FeedClient:
    """This process's connection to the feed named by AUTOLOOP_FEED (made on first use)."""
    global _client
    address = os.environ.get(ENV_FEED, "")
    if not address:
        raise HarnessError(f"{ENV_FEED} is not set: there is no data feed to connect to")
    with _client_lock:
        # A forked child (e.g. a DataLoader worker) gets its own connection.
        if _client is None or _client.pid != os.getpid() or _client.address != address:
            _client = FeedClient(address)
        return _client


def active_feed() -> FeedClient | None:
    """The feed connection when this process trains under the feed (AUTOLOOP_FEED set), else None."""
    return feed_client() if os.environ.get(ENV_FEED) else None
