"""autoloop.base.files: a folder a trial may have written is copied without following it."""

from __future__ import annotations

import os

import pytest

from autoloop.base.files import copy_regular_files


def test_only_regular_files_are_copied_and_no_link_is_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not yours")
    source = tmp_path / "cache"
    (source / "a" / "b").mkdir(parents=True)
    (source / "top.bin").write_bytes(b"\x00\x01")
    (source / "a" / "b" / "deep.txt").write_text("deep")
    (source / "STAMP").write_text("skip me")
    (source / "to_file").symlink_to(outside / "secret.txt")  # planted: read a file elsewhere
    (source / "to_dir").symlink_to(outside, target_is_directory=True)  # planted: walk a folder elsewhere
    os.mkfifo(source / "pipe")  # a reader of it would block
    dest = tmp_path / "dest"
    # A link planted at a target's name is replaced, not written through.
    dest.mkdir()
    (dest / "top.bin").symlink_to(outside / "secret.txt")

    copy_regular_files(source, dest, skip={"STAMP"})

    copied = sorted(str(p.relative_to(dest)) for p in dest.rglob("*"))
    assert copied == ["a", "a/b", "a/b/deep.txt", "top.bin"]
    assert not (dest / "top.bin").is_symlink() and (dest / "top.bin").read_bytes() == b"\x00\x01"
    assert (dest / "a" / "b" / "deep.txt").read_text() == "deep"
    assert (outside / "secret.txt").read_text() == "not yours"  # nothing written through the link


def test_a_folder_that_cannot_be_read_is_an_error(tmp_path):
    with pytest.raises(OSError):
        copy_regular_files(tmp_path / "missing", tmp_path / "dest")
