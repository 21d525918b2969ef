"""flashllm_ext.io.paths.staged_file: a file is written beside its destination and renamed over it at the end, so a
reader never meets a partial file, and a write that fails leaves the old file and no staging file behind."""

import pytest

from flashllm_ext.io.paths import staged_file


def test_the_staged_file_replaces_the_destination_when_the_block_ends(tmp_path):
    dst = tmp_path / "model.gguf"
    dst.write_bytes(b"old")
    with staged_file(dst) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".model.gguf.tmp-") and tmp.read_bytes() == b""
        tmp.write_bytes(b"new")
        assert dst.read_bytes() == b"old"  # not yet
    assert dst.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_a_failed_write_leaves_the_old_file_and_nothing_else(tmp_path):
    dst = tmp_path / "model.gguf"
    dst.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), staged_file(dst) as tmp:
        tmp.write_bytes(b"partial")
        raise KeyboardInterrupt
    assert dst.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
