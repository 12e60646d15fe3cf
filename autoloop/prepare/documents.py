"""Documents out of .txt, .jsonl and .parquet files, byte for byte, and the split each one goes to.

(autoloop.prepare: the rules of a preparation.)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Iterator


from autoloop.errors import AutoloopError
from autoloop.harness.constants import HELDOUT_BUCKETS, VAL_BUCKETS
from autoloop.prepare.common import TXT_DOC_BYTES, TXT_DOC_SEPARATOR, TXT_READ_BLOCK, need, one_line


def _txt_cut(buf: bytes, start: int, end: int) -> int | None:
    """End of the first document in buf[start:end], or None if it may still grow."""
    if end - start <= TXT_DOC_BYTES:
        return None
    limit = min(start + 4 * TXT_DOC_BYTES, end)
    blank = buf.find(b"\n\n", start + TXT_DOC_BYTES, limit)
    if blank >= 0:
        return blank + 2
    if end - start < 4 * TXT_DOC_BYTES:
        return None
    line = buf.rfind(b"\n", start + TXT_DOC_BYTES, limit)
    return line + 1 if line >= 0 else limit


def _txt_chunks(buf: bytes, start: int, end: int, final: bool):
    """Yield documents from buf[start:end]; return where the unfinished remainder starts."""
    while (cut := _txt_cut(buf, start, end)) is not None:
        if doc := buf[start:cut].strip():
            yield doc
        start = cut
    if final:
        if doc := buf[start:end].strip():
            yield doc
        return end
    return start


def txt_documents(path: Path, block_size: int = TXT_READ_BLOCK) -> Iterator[bytes]:
    """Documents of a .txt file (see the module docstring), streamed: memory stays small."""
    sep = TXT_DOC_SEPARATOR
    tail = b""
    with open(path, "rb") as handle:
        while True:
            block = handle.read(block_size)
            final = not block
            buf, pos = tail + block, 0
            while (hit := buf.find(sep, pos)) >= 0:
                yield from _txt_chunks(buf, pos, hit, final=True)
                pos = hit + len(sep)
            # A separator may be starting in the last len(sep) - 1 bytes: cut only before them.
            end = len(buf) if final else max(pos, len(buf) - len(sep) + 1)
            pos = yield from _txt_chunks(buf, pos, end, final=final)
            if final:
                return
            tail = buf[pos:]


def jsonl_documents(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise AutoloopError(f"{path}:{number} is not valid JSON ({one_line(exc, 80)}): fix or remove that line") from None
            if not isinstance(record, dict) or "text" not in record:
                fields = f" (it has {', '.join(map(str, list(record)[:8]))})" if isinstance(record, dict) else ""
                raise AutoloopError(
                    f"{path}:{number} has no \"text\" field{fields}: each line must be a JSON object with the document in \"text\""
                )
            text = record["text"]
            if not isinstance(text, str):
                raise AutoloopError(f"{path}:{number}: \"text\" is a {type(text).__name__}, not a string: store the document as a string")
            if text:
                yield text.encode("utf-8", errors="surrogatepass")


def inspect_parquet(path: Path):
    """(open ParquetFile, None), or (None, why it cannot be used) in a few words."""
    pq = need("pyarrow.parquet", "parquet", "reading .parquet files")
    import pyarrow as pa

    try:
        handle = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        return None, f"not a readable parquet file: {one_line(exc, 100)}"
    schema = handle.schema_arrow
    index = schema.get_field_index("text")
    if index < 0:
        return None, f"no \"text\" column; columns: {', '.join(schema.names[:8]) or 'none'}"
    kind = schema.field(index).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return None, f"column \"text\" holds {kind}, not strings"
    return handle, None


def open_parquet(path: Path):
    handle, problem = inspect_parquet(path)
    if problem is None:
        return handle
    if problem.startswith("not a readable"):
        raise AutoloopError(f"{path} is {problem.split(': ', 1)[0]} ({problem.split(': ', 1)[1]}): replace it with a complete copy")
    raise AutoloopError(f"{path} has {problem}: put the documents in a string column named text")


def parquet_documents(path: Path) -> Iterator[bytes]:
    handle = open_parquet(path)
    import pyarrow as pa

    for group in range(handle.num_row_groups):
        try:
            texts = handle.read_row_group(group, columns=["text"]).column(0).to_pylist()
        except (OSError, pa.ArrowException) as exc:
            raise AutoloopError(f"{path} is corrupt (row group {group}: {one_line(exc, 100)}): replace it with a complete copy") from None
        for text in texts:
            if text:
                yield text.encode("utf-8", errors="surrogatepass")


READERS: dict[str, Callable[[Path], Iterator[bytes]]] = {
    ".txt": txt_documents,
    ".jsonl": jsonl_documents,
    ".parquet": parquet_documents,
}


def bucket_of(doc: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(doc, digest_size=4).digest(), "big") % 100


def split_of_document(doc: bytes) -> str:
    """The split of a local document, by a hash of its bytes (see the module docstring)."""
    bucket = bucket_of(doc)
    return "val" if bucket in VAL_BUCKETS else "heldout" if bucket in HELDOUT_BUCKETS else "train"
