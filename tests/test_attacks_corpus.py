"""Issue 31, item 1 (the corpus half): the scored text must exist nowhere a sandbox can read.

The old embedded corpus was the interpreter's standard library, which every sandbox must
read for Python to run: a model process that rebuilt the evaluation windows from those
files and predicted each one by a causal lookup of its own prefix scored 0.08 bpb against an
honest 3.72, kept and confirmed. The corpus is now generated from a secret key in the cache
folder, which no stage of a trial sees. Two attacks through the real sandboxed loop, one run:

* "rebuild stdlib": the issue's attack, as it was written against the old corpus (the
  stdlib's files in path order, split by a hash of the path, which rebuilds the old val
  split bit for bit): kept and verified on the old main; now its tables hold text that is
  not val.
* "regenerate from the key": the same lookup on val and held-out regenerated with the
  harness's own generator from the corpus key, read in training and in the model process:
  the key is not there to read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autoloop.loop.controller import Controller
from tests.conftest import write_test_corpus_key
from tests.test_attacks import (
    BUILD_ANCHOR, IMPORT_ANCHOR, _log, _patched, _run, _seed_attacks, _trials, needs_bwrap,
)

# A causal lookup: at each position, the windows of the rebuilt text (cut where the scorer
# cuts its evaluation windows) that start with the same tokens so far, and the next token
# most of them have, at +15 logits. Its output at a position depends only on the tokens up
# to there, so no causality probe sees it; `texts` holds the rebuilt splits' tokens.
_LOOKUP = (
    "def _lookup_forward(forward, config, texts):\n"
    "    import bisect, collections\n"
    "    T = config['seq_len']\n"
    "    rows = sorted(toks[s: s + T + 1].astype('>u2').tobytes() for toks in texts\n"
    "                  for s in range(0, len(toks) - T - 1, T))\n"
    "\n"
    "    def lookup(idx, targets=None):\n"
    "        logits = forward(idx, targets)\n"
    "        if targets is not None or not rows:\n"
    "            return logits\n"
    "        x = idx.cpu().numpy().astype('>u2')\n"
    "        out = logits.clone()\n"
    "        for b in range(x.shape[0]):\n"
    "            row, lo, hi = x[b].tobytes(), 0, len(rows)\n"
    "            for t in range(x.shape[1]):\n"
    "                prefix = row[: 2 * (t + 1)]\n"
    "                lo = bisect.bisect_left(rows, prefix, lo, hi)\n"
    "                hi = bisect.bisect_right(rows, prefix + b'\\xff', lo, hi)\n"
    "                if lo >= hi:\n"
    "                    break\n"
    "                votes = collections.Counter(rows[i][2 * t + 2: 2 * t + 4] for i in range(lo, min(hi, lo + 16)))\n"
    "                nxt = int.from_bytes(votes.most_common(1)[0][0], 'big')\n"
    "                out[b, t] = -15.0\n"
    "                out[b, t, nxt] = 15.0\n"
    "        return out\n"
    "    return lookup\n\n\n"
)


def _tokens(docs) -> str:
    return "np.concatenate([np.concatenate([[256], np.frombuffer(d, dtype=np.uint8)]) for d in " + docs + "]).astype(np.int64)"


# The model process (no AUTOLOOP_RESULT) rebuilds val and held-out as the old harness made them.
REBUILD_STDLIB = _patched(BUILD_ANCHOR, (
    "    if not __import__('os').environ.get('AUTOLOOP_RESULT'):\n"
    "        model.forward = _lookup_forward(model.forward, config, _rebuilt_stdlib())\n"
    "    return model\n\n\n"
    "def _rebuilt_stdlib(cap=10 * 2**20):\n"
    "    import hashlib, pathlib, sysconfig\n"
    "    root = pathlib.Path(sysconfig.get_paths()['stdlib'])\n"
    "    skip = {'site-packages', 'dist-packages', 'test', 'tests', 'idle_test', '__pycache__'}\n"
    "    docs, total = {'val': [], 'heldout': []}, 0\n"
    "    for path in sorted(root.rglob('*.py')):\n"
    "        rel = path.relative_to(root)\n"
    "        if skip.intersection(rel.parts[:-1]) or rel.name.startswith('test_'):\n"
    "            continue\n"
    "        size = path.stat().st_size\n"
    "        if total + size > cap:\n"
    "            break\n"
    "        total += size\n"
    "        bucket = int.from_bytes(hashlib.sha256(rel.as_posix().encode()).digest()[:4], 'big') % 100\n"
    "        split = 'val' if 90 <= bucket < 95 else 'heldout' if bucket >= 95 else None\n"
    "        if split:\n"
    "            docs[split].append(path.read_bytes())\n"
    "    print('rebuilt stdlib splits:', {k: len(v) for k, v in docs.items()})\n"
    "    return [" + _tokens("docs['val']") + ", " + _tokens("docs['heldout']") + "]\n\n\n"
    + _LOOKUP))

# Training and the model process both look for the corpus key; with it, val and held-out are
# the harness's own generator away (a model process's lookup, or training on val).
REGENERATE_FROM_KEY = _patched(IMPORT_ANCHOR, IMPORT_ANCHOR + (
    "def _regenerated():\n"
    "    try:\n"
    "        from autoloop.harness import synthetic\n"
    "        from autoloop.harness.constants import EMBEDDED_DOCUMENTS\n"
    "        from autoloop.harness.corpus_key import corpus_key\n"
    "        key = corpus_key(create=False)\n"
    "    except Exception as exc:\n"
    "        print('no corpus key:', type(exc).__name__, exc)\n"
    "        return []\n"
    "    print('CORPUS KEY READ')\n"
    "    return [" + _tokens("synthetic.generate(key, s, EMBEDDED_DOCUMENTS[s])") + " for s in ('val', 'heldout')]\n\n\n"
    "if __import__('os').environ.get('AUTOLOOP_RESULT'):\n"
    "    _regenerated()\n"),
    _patched(BUILD_ANCHOR, (
        "    if not __import__('os').environ.get('AUTOLOOP_RESULT'):\n"
        "        model.forward = _lookup_forward(model.forward, config, _regenerated())\n"
        "    return model\n\n\n" + _LOOKUP)))

ATTACKS = {"rebuild stdlib": REBUILD_STDLIB, "regenerate from the key": REGENERATE_FROM_KEY}


@pytest.mark.slow
@needs_bwrap
def test_no_stage_of_a_trial_can_rebuild_the_scored_text(tmp_path, monkeypatch, attacked_repo):
    """Both attacks, sandboxed, verification on, one run: neither kept, neither better than
    the honest model it wraps, and the key read by neither stage.

    On the old main (7763598) the same run kept "rebuild stdlib", verified: 4.113 -> 0.291
    bpb at 6 steps. Here: 4.265 against the baseline's 3.984 (its few hits are wrong)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("AUTOLOOP_CACHE_DIR", str(cache))
    monkeypatch.setenv("AUTOLOOP_COMPILE_CACHE", str(cache / "compile"))
    write_test_corpus_key(cache)
    repo = attacked_repo  # the shared sandboxed baseline's run (on the session's cache), ours to run on
    names = list(ATTACKS)
    config = _run(repo, monkeypatch, max_steps=6, max_trials=len(names))
    _seed_attacks(repo, config, names, ATTACKS)
    summary = Controller(config, repo).run()
    trials = _trials(repo)
    baseline = trials["baseline"]
    assert baseline["status"] == "keep", baseline["reason"]
    assert set(names) <= set(trials), (summary.stop_reason, {k: (t["status"], t["reason"]) for k, t in trials.items()})
    figures = {name: (trials[name]["status"], trials[name]["metric"], trials[name]["reason"]) for name in names}
    assert not [name for name in names if trials[name]["status"] == "keep"], figures
    # Text that is not val gains the lookup nothing: what it finds (a window that starts, as
    # the stdlib's first val window did, with a document's BOS) only costs it.
    assert trials["rebuild stdlib"]["metric"] >= baseline["metric"], figures
    # No key, no tables: the wrapped model is the baseline's, to the last digit.
    assert trials["regenerate from the key"]["metric"] == pytest.approx(baseline["metric"], abs=1e-9), figures
    log = _log(repo, trials["regenerate from the key"])
    # Its training log and its model process's log ([model] lines) both say so.
    assert "no corpus key" in log and "CORPUS KEY READ" not in log, log[-2000:]
