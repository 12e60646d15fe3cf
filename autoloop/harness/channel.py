"""The channel between the scorer and the model process of a split evaluation.

The evaluation runs in two processes (autoloop.harness.evaluate): the *scorer*, harness
code only, holds the splits and computes the loss; the *model process*
(autoloop.harness.model_server) runs the trial's code in a sandbox that shows it no data
file and lets it write nothing that outlives it. The controller's side creates both ends
of this channel and hands one to each process as inherited file descriptors, so neither
process opens anything by path:

* a unix stream socket pair for small frames (each a 5-byte header, payload length as a
  big-endian uint32 and a kind byte, then the payload);
* a shared memory region (a memfd) for the model's outputs, which are too big for the
  socket at GPU scale (a batch of 32 x 2048 positions x a padded vocabulary of 320 is
  84 MB of float32).

Frames:

    model  -> scorer  READY  JSON {"vocab_size", "params"}        the model is built
    scorer -> model   RUN    uint32 id, B, T, then B*T int32 tokens
    model  -> scorer  CHUNK  uint32 id, row0, rows, width, dtype   rows x width float32 (or bf16) in the region
    scorer -> model   ACK    (empty)                               the region may be reused
    model  -> scorer  DONE   uint32 id                             every row of batch `id` was sent
    model  -> scorer  ERROR  utf-8 text                            the model raised
    scorer -> model   BYE    (empty)                               the model process exits

Everything the scorer reads from the model process is untrusted data: the model process
runs the trial's code, which can replace this module's functions inside that process or
write anything to its end of the socket and the region. The scorer therefore checks every
header against what it asked for (`expect_chunk`), copies each chunk out of the region
before it acknowledges it, and bounds every length. A malformed frame is a `ChannelError`,
which the scorer reports as the trial's failure.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct

READY, RUN, CHUNK, ACK, DONE, ERROR, BYE = 1, 2, 3, 4, 5, 6, 7
_HEADER = struct.Struct(">IB")
_RUN = struct.Struct(">III")
_CHUNK = struct.Struct(">IIIIB")
# The element types a chunk of outputs may come in: float32, or bfloat16 when the model ran
# under bf16 autocast (a GPU): its logits are bf16 already, so sending them as they are
# halves the bytes and changes no value.
FLOAT32, BFLOAT16 = 0, 1
ITEMSIZE = {FLOAT32: 4, BFLOAT16: 2}
_DONE = struct.Struct(">I")
MAX_CONTROL_BYTES = 1 << 20  # READY, ERROR: small JSON or text
MAX_RUN_BYTES = 64 << 20  # the tokens of one batch (int32)
MAX_ERROR_CHARS = 2000
# The output region: big enough for a CPU batch in one chunk and a GPU batch in a few.
DEFAULT_REGION_BYTES = 64 << 20
# How much wider than the vocabulary the model's output rows may be (a padded lm_head):
# train.py pads to a multiple of 64; nothing honest needs more than this.
MAX_PADDING = 4096


class ChannelError(Exception):
    """The other side broke the protocol (or closed the channel)."""


def make_region(size: int = DEFAULT_REGION_BYTES) -> int:
    """A shared memory region of `size` bytes, as a file descriptor both processes inherit."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("autoloop-eval", 0)  # no MFD_CLOEXEC: it is passed to the children
    else:  # pragma: no cover - not Linux: an unlinked temporary file does the same
        import tempfile

        handle = tempfile.TemporaryFile()
        fd = os.dup(handle.fileno())
        handle.close()
    os.ftruncate(fd, size)
    return fd


class Region:
    """The shared output region, mapped."""

    def __init__(self, fd: int):
        self.size = os.fstat(fd).st_size
        self.map = mmap.mmap(fd, self.size)

    def close(self) -> None:
        self.map.close()


class Channel:
    """One end of the socket pair."""

    def __init__(self, fd: int, *, timeout: float | None = None):
        self.sock = socket.socket(fileno=fd)
        self.sock.settimeout(timeout)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # ---- framing

    def send(self, kind: int, payload: bytes = b"") -> None:
        self.sock.sendall(_HEADER.pack(len(payload), kind) + payload)

    def _recv_exact(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            try:
                block = self.sock.recv(min(n - got, 1 << 20))
            except socket.timeout:
                raise ChannelError("the model process did not answer in time") from None
            except OSError as exc:
                raise ChannelError(f"the channel broke ({exc.strerror or exc})") from None
            if not block:
                raise ChannelError("the model process closed the channel" if got == 0 else
                                   f"the channel closed in the middle of a frame ({got} of {n} bytes)")
            chunks.append(block)
            got += len(block)
        return b"".join(chunks)

    def recv(self, limit: int = MAX_CONTROL_BYTES) -> tuple[int, bytes]:
        length, kind = _HEADER.unpack(self._recv_exact(_HEADER.size))
        if length > limit:
            raise ChannelError(f"a frame of {length} bytes (kind {kind}), more than the {limit} allowed")
        return kind, self._recv_exact(length) if length else b""

    # ---- the model's side

    def ready(self, vocab_size: int, params: int) -> None:
        self.send(READY, json.dumps({"vocab_size": int(vocab_size), "params": int(params)}).encode())

    def next_request(self) -> tuple[int, int, int, bytes] | None:
        """(id, B, T, tokens) of the next batch, or None when the scorer says goodbye."""
        kind, payload = self.recv(MAX_RUN_BYTES)
        if kind == BYE:
            return None
        if kind != RUN or len(payload) < _RUN.size:
            raise ChannelError(f"expected a batch, got a frame of kind {kind}")
        batch_id, b, t = _RUN.unpack_from(payload)
        return batch_id, b, t, payload[_RUN.size:]

    def chunk(self, batch_id: int, row0: int, rows: int, width: int, dtype: int = FLOAT32) -> None:
        self.send(CHUNK, _CHUNK.pack(batch_id, row0, rows, width, dtype))
        kind, _ = self.recv()
        if kind != ACK:
            raise ChannelError(f"expected an acknowledgement, got a frame of kind {kind}")

    def done(self, batch_id: int) -> None:
        self.send(DONE, _DONE.pack(batch_id))

    def error(self, text: str) -> None:
        self.send(ERROR, text[:MAX_ERROR_CHARS].encode("utf-8", "replace"))

    # ---- the scorer's side

    def wait_ready(self) -> dict:
        kind, payload = self.recv()
        if kind == ERROR:
            raise ModelFailed(payload.decode("utf-8", "replace"))
        if kind != READY:
            raise ChannelError(f"expected the model to say it is ready, got a frame of kind {kind}")
        try:
            info = json.loads(payload)
        except ValueError:
            raise ChannelError("the model's ready message is not JSON") from None
        if not isinstance(info, dict):
            raise ChannelError("the model's ready message is not an object")
        return info

    def request(self, batch_id: int, tokens) -> None:
        """Send one batch: `tokens` a (B, T) integer array."""
        import numpy as np

        array = np.ascontiguousarray(tokens, dtype=np.int32)
        b, t = array.shape
        self.send(RUN, _RUN.pack(batch_id, b, t) + array.tobytes())

    def expect_chunk(self, batch_id: int, next_row: int, total_rows: int, vocab_size: int,
                     region_bytes: int) -> tuple[int, int, int] | None:
        """The next chunk's (rows, width, dtype) after checking its header against the request, or
        None when the model says the batch is done (only valid once every row came)."""
        kind, payload = self.recv()
        if kind == ERROR:
            raise ModelFailed(payload.decode("utf-8", "replace"))
        if kind == DONE:
            if len(payload) != _DONE.size or _DONE.unpack(payload)[0] != batch_id:
                raise ChannelError("the model finished another batch than the one asked for")
            if next_row != total_rows:
                raise ChannelError(f"the model returned {next_row} of the batch's {total_rows} positions")
            return None
        if kind != CHUNK or len(payload) != _CHUNK.size:
            raise ChannelError(f"expected outputs, got a frame of kind {kind} ({len(payload)} bytes)")
        got_id, row0, rows, width, dtype = _CHUNK.unpack(payload)
        if got_id != batch_id:
            raise ChannelError(f"the model answered batch {got_id} when batch {batch_id} was asked for")
        if row0 != next_row or rows < 1 or row0 + rows > total_rows:
            raise ChannelError(f"the model sent positions {row0}..{row0 + rows} out of order (expected {next_row} "
                               f"of {total_rows})")
        if not vocab_size <= width <= vocab_size + MAX_PADDING:
            raise ChannelError(f"the model's outputs are {width} wide for a vocabulary of {vocab_size}")
        if dtype not in ITEMSIZE:
            raise ChannelError(f"the model's outputs came in an unknown element type ({dtype})")
        if rows * width * ITEMSIZE[dtype] > region_bytes:
            raise ChannelError("the model's chunk is larger than the shared region")
        return rows, width, dtype

    def ack(self) -> None:
        self.send(ACK)

    def bye(self) -> None:
        try:
            self.send(BYE)
        except OSError:
            pass


class ModelFailed(Exception):
    """The model process reported an error (its text is the trial's, untrusted)."""
