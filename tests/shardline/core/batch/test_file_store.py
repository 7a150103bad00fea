"""The local file store: a file is listed only once whole, and ids never reach outside its folder."""

from __future__ import annotations

import pytest

from shardline.core.batch.file_store import FileObject, FileStoreUnavailable, LocalFileStore
from shardline.core.errors import InvalidArgument


def test_write_read_list_delete(tmp_path):
    store = LocalFileStore(tmp_path)
    meta = store.write(FileObject("file-1", 0, 10, "a.jsonl", "batch", "k"), [b"ab", b"cd\n"])
    assert meta.bytes == 5
    store.write(FileObject("file-2", 0, 20, "b.jsonl", "batch"), [b"x"])
    (tmp_path / "file-3").write_bytes(b"no metadata: an upload cut short")
    assert [f.id for f in store.list()] == ["file-2", "file-1"]
    with store.open("file-1") as source:
        assert source.read() == b"abcd\n"
    assert store.get("file-1").owner == "k"
    assert store.delete("file-1") and not store.delete("file-1")
    assert store.get("file-1") is None


def test_ids_cannot_name_paths(tmp_path):
    store = LocalFileStore(tmp_path / "files")
    with pytest.raises(InvalidArgument):
        store.get("../secret")


def test_a_store_that_cannot_be_written_is_unavailable_naming_its_folder(tmp_path):
    """A folder gone, or one the service's user may not write (a volume owned by root): 503, not 500."""
    store = LocalFileStore(tmp_path / "files")
    store.root.rmdir()
    store.root.write_text("not a folder any more")
    with pytest.raises(FileStoreUnavailable, match=f"cannot write to the file store {store.root}") as refused:
        store.write(FileObject("file-1", 0, 10, "a.jsonl", "batch"), [b"{}\n"])
    assert refused.value.http_status == 503
