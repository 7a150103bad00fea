"""Where uploaded files and batch results live: a folder by default, behind an interface small enough
for an object store.

The gateway writes uploads and serves downloads; batch workers read inputs and write outputs, so in a
deployment the folder is a volume both mount. Each file is two objects: its bytes, and a JSON sidecar
with the OpenAI file object and its owner, written after the bytes, so a file without a sidecar was
never finished and is never listed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, BinaryIO, Protocol

from shardline.core.errors import InvalidArgument, Unavailable

_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
# OpenAI's purposes; batches read "batch" files and write "batch_output" ones.
PURPOSES = ("batch", "batch_output", "fine-tune", "assistants", "vision", "user_data", "evals")


@dataclass(slots=True)
class FileObject:
    """OpenAI's file object, plus who owns it."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    owner: str = ""  # digest of the API key that uploaded it; "" with keys off

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
        }


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


class FileStore(Protocol):
    """A file store: an object store fits it as well as a folder."""

    def write(self, meta: FileObject, chunks: Iterable[bytes]) -> FileObject:
        """Store the bytes, then the metadata; returns the metadata with its size."""

    def get(self, file_id: str) -> FileObject | None:
        """The file's metadata; None when there is no such finished file."""

    def open(self, file_id: str) -> BinaryIO:
        """The file's bytes, to read (seekable)."""

    def list(self) -> list[FileObject]:
        """Every finished file, newest first."""

    def delete(self, file_id: str) -> bool:
        """Remove the file; False when there was none."""


class FileStoreUnavailable(Unavailable):
    """The folder cannot be read or written (its permissions, a full disk, a volume gone): 503, naming
    the folder and the reason, rather than a 500 with nothing to act on."""


class LocalFileStore:
    """Files in one folder: `<id>` holds the bytes and `<id>.json` the metadata."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, file_id: str) -> Path:
        # Letters, digits, '-' and '_' only: an id never names a path outside the folder.
        if not _SAFE_ID.fullmatch(file_id):
            raise InvalidArgument("file_id", f"must be letters, digits, '-' and '_', got {file_id[:64]!r}")
        return self.root / file_id

    @contextmanager
    def _storage(self, action: str) -> Iterator[None]:
        try:
            yield
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise FileStoreUnavailable(
                f"files: cannot {action} the file store {self.root} ({exc.strerror or exc}); its folder must be "
                f"writable by the service's user"
            ) from exc

    def write(self, meta: FileObject, chunks: Iterable[bytes]) -> FileObject:
        with self._storage("write to"):
            return self._write(meta, chunks)

    def _write(self, meta: FileObject, chunks: Iterable[bytes]) -> FileObject:
        path = self._path(meta.id)
        part = path.with_name(f"{path.name}.part-{secrets.token_hex(4)}")
        size = 0
        with open(part, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                size += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(part, path)  # a rewrite (a batch's output, finalized again) replaces it whole
        meta.bytes = size
        sidecar = path.with_name(f"{path.name}.json.part-{secrets.token_hex(4)}")
        sidecar.write_text(json.dumps(asdict(meta)))
        os.replace(sidecar, path.with_name(f"{path.name}.json"))
        return meta

    def get(self, file_id: str) -> FileObject | None:
        path = self._path(file_id).with_name(f"{file_id}.json")
        try:
            with self._storage("read"):
                return FileObject(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None

    def open(self, file_id: str) -> BinaryIO:
        with self._storage("read"):
            return open(self._path(file_id), "rb")

    def list(self) -> list[FileObject]:
        with self._storage("list"):
            files = [meta for meta in (self.get(p.stem) for p in self.root.glob("*.json")) if meta is not None]
        return sorted(files, key=lambda f: (f.created_at, f.id), reverse=True)

    def delete(self, file_id: str) -> bool:
        path = self._path(file_id)
        found = False
        for target in (path.with_name(f"{file_id}.json"), path):  # the metadata first: it is what lists it
            try:
                with self._storage("delete from"):
                    target.unlink()
                found = True
            except FileNotFoundError:
                pass
        return found


def read_chunks(source: IO[bytes], size: int = 1 << 20) -> Iterator[bytes]:
    while chunk := source.read(size):
        yield chunk


def now_s() -> int:
    return int(time.time())
