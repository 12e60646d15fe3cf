"""The embedded corpus: generated from a secret key, rebuildable from no file a sandbox reads.

The key's life (made once, atomically, 0600, never in a child's environment), the corpus's
dependence on it (another key, another text and another fingerprint; the same key, the same
bytes), and that val and held-out text is nowhere on disk but in the prepared dataset.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from autoloop import harness as H
from autoloop.harness import synthetic
from autoloop.harness.corpus_key import KEY_BYTES, corpus_key, corpus_key_path, key_id, write_key
from autoloop.base.environment import allowed_environment
from tests.conftest import REPO_ROOT, TEST_CORPUS_KEY

KEY_A, KEY_B = bytes(range(32)), bytes(range(100, 132))


# ---------------------------------------------------------------------------- the key


def test_the_key_is_made_on_first_use_with_mode_0600_and_kept(tmp_path):
    key = corpus_key(tmp_path)
    path = corpus_key_path(tmp_path)
    assert len(key) == KEY_BYTES and path.read_bytes() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert corpus_key(tmp_path) == key  # read again, not made again
    assert sorted(p.name for p in path.parent.iterdir()) == ["corpus.key"]  # no temporary file left
    assert corpus_key(tmp_path / "other") != key  # os.urandom, not a constant


_RACE = """
import sys, time
sys.path.insert(0, sys.argv[1])
from autoloop.harness.corpus_key import corpus_key
while time.time() < float(sys.argv[3]):
    pass
print(corpus_key(sys.argv[2]).hex())
"""


def test_processes_racing_to_make_the_key_all_get_the_same_one(tmp_path):
    import time

    start = time.time() + 1.5  # every process spins until then, then all make the key at once
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(REPO_ROOT), str(tmp_path), str(start)],
                              stdout=subprocess.PIPE, text=True) for _ in range(6)]
    keys = {proc.communicate(timeout=60)[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    assert keys == {corpus_key_path(tmp_path).read_bytes().hex()}
    assert sorted(p.name for p in corpus_key_path(tmp_path).parent.iterdir()) == ["corpus.key"]


def test_a_key_others_can_read_or_of_the_wrong_size_is_refused_in_one_line(tmp_path):
    path = write_key(corpus_key_path(tmp_path), KEY_A)
    path.chmod(0o644)
    with pytest.raises(H.HarnessError) as err:
        corpus_key(tmp_path)
    assert f"chmod 600 {path}" in str(err.value) and "\n" not in str(err.value)
    path.chmod(0o600)
    path.write_bytes(KEY_A[:7])
    with pytest.raises(H.HarnessError) as err:
        corpus_key(tmp_path)
    assert "has 7 bytes, not 32" in str(err.value) and "delete it" in str(err.value)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(H.HarnessError, match="must be a regular file"):
        corpus_key(tmp_path)


def test_the_key_is_in_no_childs_environment(tmp_path, monkeypatch):
    """Nothing puts the key into an environment: a child's (the allow-list's) holds it in no
    encoding, and a real child started with it cannot print it."""
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(tmp_path))
    H.prepare_embedded(tmp_path / "data" / "synthetic-v1")
    key = corpus_key(tmp_path, create=False)
    assert key != TEST_CORPUS_KEY
    forms = [key.hex(), key.hex().upper(), base64.b64encode(key).decode(), key.decode("latin-1")]
    env = allowed_environment({"AUTOLOOP_DATA_DIR": str(tmp_path / "view"), "AUTOLOOP_SEED": 1})
    assert not [name for name, value in env.items() if any(form in value for form in forms)]
    out = subprocess.run([sys.executable, "-c", "import os; print(repr(dict(os.environ)))"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert not any(form in out for form in forms)


# ---------------------------------------------------------------------------- the corpus


def _docs(key: bytes, split: str, count: int) -> list[bytes]:
    return list(synthetic.generate(key, split, count))


def test_two_keys_give_different_text_and_one_key_the_same_bytes():
    a, b = _docs(KEY_A, "val", 6), _docs(KEY_B, "val", 6)
    assert a == _docs(KEY_A, "val", 6)
    assert not set(a) & set(b)
    def pairs(docs: list[bytes]) -> set:
        words = [w.strip(b".,?!:").lower() for w in b" ".join(docs).split()]
        return set(zip(words, words[1:]))

    # Another key is another language, not other sentences of the same one: its short words
    # may coincide (a syllable or two of the same letters), which word follows which does not.
    pairs_a, pairs_b = pairs(a), pairs(b)
    assert len(pairs_a & pairs_b) < 0.05 * min(len(pairs_a), len(pairs_b))


def test_a_document_depends_on_the_key_the_split_and_its_index_only():
    # Generated alone or in a batch of many, document i is the same; splits do not share documents.
    alone = _docs(KEY_A, "heldout", 2)
    batch = _docs(KEY_A, "heldout", synthetic.BATCH + 3)
    assert batch[:2] == alone and len(set(batch)) == len(batch)
    assert not set(_docs(KEY_A, "val", 20)) & set(_docs(KEY_A, "train", 20))
    assert synthetic.document_seed(KEY_A, "val", 1) != synthetic.document_seed(KEY_A, "heldout", 1)


def test_the_text_has_the_promised_structure():
    text = b"".join(_docs(KEY_A, "train", 200)).decode("ascii")
    lines = text.splitlines()
    assert any(line.startswith("      - ") for line in lines)  # outline items three levels deep
    assert max(len(line) for line in lines if not line.lstrip().startswith("-")) <= max(synthetic.WIDTHS) + 40
    assert any(ch.isdigit() for ch in text) and "," in text and "?" in text and "!" in text
    words = [w.strip(".,?!:-") for w in text.split()]
    counts = np.sort(np.unique([w.lower() for w in words if w.isalpha()], return_counts=True)[1])[::-1]
    # Zipf: the 10th word is several times rarer than the 1st, and a long tail of rare words.
    assert counts[0] > 3 * counts[9] and (counts <= 3).sum() > 500


def _trigram_bpb(train: bytes, test: bytes) -> float:
    """Bits per byte of an add-one trigram byte model fitted on `train`: a fixed learner, so
    its figure moves only with the language's entropy."""
    def ids(data: bytes) -> np.ndarray:
        a = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
        return (a[:-2] * 128 + a[1:-1]) * 128 + a[2:], a[:-2] * 128 + a[1:-1]

    tri, bi = ids(train)
    tri_counts = np.bincount(tri, minlength=128**3)
    bi_counts = np.bincount(bi, minlength=128**2)
    t_tri, t_bi = ids(test)
    p = (tri_counts[t_tri] + 1) / (bi_counts[t_bi] + 128)
    return float(-np.log2(p).mean())


def test_the_languages_entropy_is_nearly_the_same_whatever_the_key():
    """The statistics are fixed and only identities come from the key: a fixed learner scores
    five keys within a small spread. The known answer beside it: the same learner, fitted on
    one key's text and scoring another key's, is far off, so it does tell languages apart."""
    keys = [bytes([k]) * 32 for k in range(5)]
    figures = [_trigram_bpb(b"".join(_docs(k, "train", 200)), b"".join(_docs(k, "val", 40))) for k in keys]
    assert max(figures) - min(figures) < 0.08, figures
    assert 2.5 < np.mean(figures) < 4.0, figures
    other = _trigram_bpb(b"".join(_docs(keys[0], "train", 200)), b"".join(_docs(keys[1], "val", 40)))
    assert other > max(figures) + 0.3, (other, figures)


def test_the_embedded_dataset_names_its_key_by_a_digest_in_its_fingerprint(embedded_dataset, tmp_path, monkeypatch):
    assert embedded_dataset.name == "synthetic-v1"
    assert embedded_dataset.meta["key_id"] == key_id(TEST_CORPUS_KEY)
    raw = (embedded_dataset.path / "meta.json").read_text()
    assert TEST_CORPUS_KEY.hex() not in raw and base64.b64encode(TEST_CORPUS_KEY).decode() not in raw
    # Another key: another corpus, another fingerprint, so a db made on one refuses the other.
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(tmp_path))
    write_key(corpus_key_path(tmp_path), KEY_B)
    other = H.prepare_embedded(tmp_path / "data" / "synthetic-v1")
    assert other.fingerprint != embedded_dataset.fingerprint
    assert other.meta["key_id"] == key_id(KEY_B) != embedded_dataset.meta["key_id"]
    assert json.loads((other.path / "meta.json").read_text())["splits"]["val"]["documents"] == \
        H.data.EMBEDDED_DOCUMENTS["val"]


def _windows(ds, split: str, count: int) -> list[bytes]:
    tokens = np.asarray(ds.split(split))
    rng = np.random.default_rng(7)
    out = []
    while len(out) < count:
        start = int(rng.integers(0, len(tokens) - 64))
        window = tokens[start: start + 64]
        if (window < 256).all():
            out.append(bytes(window.astype(np.uint8)))
    return out


@pytest.mark.slow
def test_no_val_or_heldout_text_is_in_the_interpreter_its_packages_or_the_repository(embedded_dataset, tmp_path):
    """Sampled 64-byte windows of val and held-out are in no file under sys.prefix,
    sys.base_prefix or the repository. The known answer: a window of a stdlib file, searched
    the same way, is found."""
    stdlib_file = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    control = stdlib_file.read_bytes()[5000:5064]
    windows = _windows(embedded_dataset, "val", 4) + _windows(embedded_dataset, "heldout", 4)
    patterns = tmp_path / "patterns"
    # grep -F takes one pattern per line: search each window's longest line-free piece.
    pieces = [max(w.split(b"\n"), key=len) for w in windows]
    assert min(len(p) for p in pieces) >= 24
    patterns.write_bytes(b"\n".join([*pieces, max(control.split(b"\n"), key=len)]) + b"\n")
    roots = sorted({sys.prefix, sys.base_prefix, str(REPO_ROOT)})
    found = subprocess.run(["grep", "-r", "-a", "-o", "-h", "-F", "-f", str(patterns), *roots],
                           capture_output=True, timeout=1200).stdout.splitlines()
    assert max(control.split(b"\n"), key=len) in found  # the search works
    assert not set(found) & set(pieces), set(found) & set(pieces)
