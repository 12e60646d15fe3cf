"""Proposal materialization and validation, and the constants editor."""

import pytest

from autoloop.errors import AutoloopError
from autoloop.proposers.proposal import Edit, InvalidProposal, Proposal, materialize, validate
from autoloop.pyconst import Expression, parse_value, read_constants, set_constants

SOURCE = '''"""doc"""
import os

LR = 0.04  # matrix lr
BATCH: int = 2**19  # tokens
NAME = "adamw"
É = 1; WIDTH = 64
if os.environ.get("X"):
    LR = 0.1
'''


def test_read_constants_top_level_only():
    consts = read_constants(SOURCE)
    assert set(consts) == {"LR", "BATCH", "NAME", "WIDTH"}
    assert consts["BATCH"].value == 2**19 and consts["BATCH"].source == "2**19"
    assert consts["LR"].comment == "matrix lr"


def test_set_constants_is_a_one_line_edit_keeping_comments():
    out = set_constants(SOURCE, {"LR": 0.02, "BATCH": parse_value("2**18"), "NAME": "muon", "WIDTH": 128})
    assert "LR = 0.02  # matrix lr\n" in out
    assert "BATCH: int = 2**18  # tokens" in out
    assert "NAME = 'muon'" in out
    assert "É = 1; WIDTH = 128" in out
    assert out.count("\n") == SOURCE.count("\n")
    assert isinstance(parse_value("2**18"), Expression) and parse_value("0.5") == 0.5


def test_unknown_constant_names_the_known_ones():
    with pytest.raises(AutoloopError, match="has no constant NOPE: use one of its UPPER_CASE constants"):
        set_constants(SOURCE, {"NOPE": 1})


def parent(files):
    return lambda path: files.get(path)


def test_materialize_and_validate_search_replace():
    files = {"train.py": SOURCE, "autoloop/harness/metric.py": "x = 1\n"}
    proposal = Proposal("tweak", [Edit("train.py", search="LR = 0.04", replace="LR = 0.05")])
    changed = validate(materialize(proposal, ".", "HEAD", parent(files)), parent(files),
                       editable=["train.py"], protected=["autoloop/**"])
    assert changed["train.py"].count("LR = 0.05") == 1


@pytest.mark.parametrize(
    "edit, message",
    [
        (Edit("train.py", search="nowhere", replace="x"), "is not found"),
        (Edit("train.py", search="LR = 0.", replace="x"), "matches 2 places"),
        (Edit("train.py", sets={"NOPE": 1}), "has no constant NOPE"),
        (Edit("missing.py", search="a", replace="b"), "does not exist in the parent commit"),
    ],
)
def test_materialize_failures(edit, message):
    with pytest.raises(InvalidProposal, match=message):
        materialize(Proposal("x", [edit]), ".", "HEAD", parent({"train.py": SOURCE}))


@pytest.mark.parametrize(
    "files, message",
    [
        ({"autoloop/harness/metric.py": "x = 2\n"}, "edits protected file autoloop/harness/metric.py"),
        ({"other.py": "x = 2\n"}, "edits other.py, which is not editable"),
        ({"../escape.py": "x"}, "outside the repository"),
        ({"train.py": SOURCE}, "changes nothing"),
        ({"train.py": "def f(:\n"}, "syntax error in train.py line 1"),
    ],
)
def test_validation_failures(files, message):
    with pytest.raises(InvalidProposal, match=message):
        validate(files, parent({"train.py": SOURCE}), editable=["train.py"], protected=["autoloop/**"])


def test_patches_reach_git_as_the_exact_bytes_and_results_must_be_utf8(tmp_path):
    import json
    import subprocess

    from conftest import make_repo
    from autoloop.proposers.proposal import patch_bytes, patch_text

    repo = make_repo(tmp_path / "r", "# caf\u00e9\nLR = 0.04\n")
    parent = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    read = lambda path: (repo / path).read_text() if path == "train.py" else None  # noqa: E731
    diff = "--- a/train.py\n+++ b/train.py\n@@ -1,2 +1,2 @@\n # caf\u00e9\n-LR = 0.04\n+LR = 0.02\n"
    for patch in (diff, diff.encode()):  # text, or bytes read back from a BLOB
        files = materialize(Proposal("lr", patch=patch), str(repo), parent, read)
        assert files == {"train.py": "# caf\u00e9\nLR = 0.02\n"}
    latin1 = diff.replace("+LR = 0.02", "+LR = 0.02  # d\u00e9j\u00e0").encode("utf-8").replace("d\u00e9j\u00e0".encode(), b"d\xe9j\xe0")
    assert patch_bytes(patch_text(latin1)) == latin1  # undecodable bytes survive as surrogates
    with pytest.raises(InvalidProposal, match=r"train.py would not be UTF-8 text after the patch \(byte 0xe9"):
        materialize(Proposal("latin-1", patch=patch_text(latin1)), str(repo), parent, read)
    stored = json.loads(Proposal("latin-1", patch=latin1).to_json())["patch"]  # storable, and exact
    assert patch_bytes(stored) == latin1


def test_anything_raising_in_materialize_or_validate_is_an_invalid_proposal():
    class Odd:
        def __repr__(self):
            raise RuntimeError("no repr")

    with pytest.raises(InvalidProposal, match="^the proposal cannot be applied: RuntimeError: no repr$"):
        materialize(Proposal("odd", [Edit("train.py", sets={"LR": Odd()})]), ".", "HEAD", lambda p: "LR = 1\n")
    with pytest.raises(InvalidProposal, match=r"the new content of train.py is not text \(int\)"):
        validate({"train.py": 3}, lambda p: "", editable=["train.py"], protected=[])
    with pytest.raises(OSError):  # a full disk is not the proposal's fault: it propagates
        def full(path):
            raise OSError(28, "No space left on device")

        materialize(Proposal("x", [Edit("train.py", search="a", replace="b")]), ".", "HEAD", full)
