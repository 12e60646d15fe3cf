"""Preparing real datasets: named Hub datasets or local files -> a prepared dataset folder.

`prepare_dataset(...)` downloads or reads the text, trains a BPE tokenizer if asked, and
writes `cache_root()/data/<name>` with the harness's atomic writer (write_dataset), so a
failed or interrupted preparation never damages a dataset prepared before.

Rules that are not obvious from the code:

Splits (the data-split contract: train, val, heldout).
- Named Hub datasets come in numbered shards. `train` is the first N shards; `val` is
  the last shard, pinned (climbmix's shard_06542, as in autoresearch); `heldout` is the
  shard before it, also pinned, so adding train shards never moves either. A dataset
  that pins one file for both (TinyStories' valid file) divides its documents between
  val and heldout by a hash of their text.
- Local files (`--dataset PATH`) are assigned per document by a hash of the document's
  bytes: buckets 90-94 of 100 go to val, 95-99 to heldout (the embedded corpus's
  proportions). Hashing the content, not the position, sends duplicates to the same
  split, so a repeated document cannot leak from train into val.
- `val` and `heldout` keep whole documents, in file order, up to EVAL_SPLIT_BYTE_CAP of
  text: evaluation reads only the first `eval_tokens` (8M tokens, ~40 MB of text on
  CUDA), so the rest of a pinned shard would be unused disk and preparation time.

Documents.
- `.jsonl`: one JSON object per line, the document in its "text" field. `.parquet`: one
  document per row of the "text" column. Empty documents are skipped; others are kept
  byte for byte.
- `.txt`: documents are separated by `<|endoftext|>` (TinyStories' and GPT-2's
  convention). A longer stretch is cut into documents at the first blank line after
  TXT_DOC_BYTES (at a line end if there is no blank line within 4x that), so a single
  text file (a novel, tinyshakespeare) still yields enough documents for the hash split.
  Each .txt document is stripped of surrounding whitespace.
- Text is never decoded and re-encoded on its way to the tokenizer: both tokenizers see
  the same bytes, so the metric's byte counts, and val_bpb, are comparable across them.

Tokenizer. The BPE vocabulary is learned with rustbpe from the first
TOKENIZER_SAMPLE_CHARS characters of the train split (each document truncated to
SAMPLE_DOC_CHARS characters, as autoresearch does, so one huge document cannot dominate the counts); val
and heldout are never seen. Its size includes one BOS token. Documents are packed
BOS-aligned without padding: each is written after a BOS token, back to back.

Downloads. Hub files go to `hub_dir()/<owner>/<repo>/` ($AUTOLOOP_HUB_DIR, else
`cache_root()/hub`, which honours $AUTOLOOP_CACHE_DIR) through huggingface_hub, which
honours HF_ENDPOINT and HF_TOKEN. Each file is fetched whole and kept: a rerun skips
complete files without any network request and re-fetches a file that fails its size or
parquet check. The first download pins the repository's commit in
`.autoloop-manifest.json`, so shards fetched on different days come from one revision.
A lock file keeps two preparations of one repository from downloading the same shard.
"""

from __future__ import annotations

from autoloop.prepare.common import (  # noqa: F401
    ConsoleReporter,
    DEFAULT_HUB_ENDPOINT,
    DEFAULT_VOCAB_SIZE,
    ENCODE_BATCH_BYTES,
    ENCODE_BATCH_DOCS,
    ENV_HUB_DIR,
    EVAL_SPLIT_BYTE_CAP,
    HUB_METADATA_TIMEOUT,
    MANIFEST,
    MAX_VOCAB_SIZE,
    MIN_VOCAB_SIZE,
    NAME_RE,
    RECIPE_VERSION,
    Reporter,
    SAMPLE_DOC_CHARS,
    TOKENIZER_SAMPLE_CHARS,
    TXT_DOC_BYTES,
    TXT_DOC_SEPARATOR,
    TXT_READ_BLOCK,
    format_count,
    format_size,
    need,
    one_line,
)
from autoloop.prepare.documents import (  # noqa: F401
    READERS,
    bucket_of,
    inspect_parquet,
    jsonl_documents,
    open_parquet,
    parquet_documents,
    split_of_document,
    txt_documents,
)
from autoloop.prepare.hub import (  # noqa: F401
    DATASETS,
    HubDataset,
    check_download,
    download,
    find_hub_dataset,
    hub_dir,
    hub_endpoint,
    read_manifest,
)
from autoloop.prepare.sources import (  # noqa: F401
    Source,
    hub_source,
    local_files,
    local_source,
    resolve_source,
)
from autoloop.prepare.tokenizer import (  # noqa: F401
    check_vocab_size,
    encode_threads,
    encoded,
    train_bpe,
)
from autoloop.prepare.dataset import (  # noqa: F401
    DownloadInfo,
    Prepared,
    PreparedInfo,
    check_name,
    list_downloads,
    list_prepared,
    prepare_dataset,
    prepared_root,
    resolve_data_dir,
)
