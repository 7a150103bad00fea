"""OpenAI's Files API, for batch inputs and outputs: upload, list, read, download and delete.

Files live in the file store shared with the batch workers; each belongs to the API key that
uploaded it (or wrote the batch it came out of), and another key's file is a 404, as an unknown one.
"""

from __future__ import annotations

import asyncio
import tempfile

from aiohttp import BodyPartReader, web

from gateway.auth import ApiKeys
from shardline.batch.file_store import PURPOSES, FileObject, FileStore, new_file_id, now_s, read_chunks
from shardline.batch.input_lines import MAX_FILE_BYTES
from shardline.errors import InvalidArgument, NotFound

# Bytes read from an upload at a time.
_READ_BYTES = 1 << 20
# An upload is spooled in memory up to this size, then on disk.
_SPOOL_BYTES = 8 << 20


class FilesApi:
    """Routes of /v1/files."""

    def __init__(self, store: FileStore, keys: ApiKeys) -> None:
        self._store = store
        self._keys = keys

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files", self.list)
        app.router.add_get("/v1/files/{file_id}", self.retrieve)
        app.router.add_delete("/v1/files/{file_id}", self.delete)
        app.router.add_get("/v1/files/{file_id}/content", self.content)

    def owner(self, request: web.Request) -> str:
        return self._keys.owner(request.headers.get("Authorization"))

    async def owned(self, file_id: str, owner: str) -> FileObject:
        """The file's metadata if `owner` may read it; NotFound otherwise."""
        meta = await asyncio.to_thread(self._store.get, file_id) if _plausible(file_id) else None
        if meta is None or meta.owner != owner:
            raise NotFound(f"file_id: no file {file_id!r}")
        return meta

    async def upload(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise InvalidArgument("file", "upload the file as multipart/form-data, with the fields file and purpose")
        purpose = filename = None
        with tempfile.SpooledTemporaryFile(_SPOOL_BYTES) as spool:
            size = 0
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    raise InvalidArgument("file", "nested multipart bodies are not accepted")
                if part.name == "purpose":
                    purpose = (await part.text()).strip()
                elif part.name == "file":
                    filename = part.filename or "upload.jsonl"
                    while chunk := await part.read_chunk(_READ_BYTES):
                        size += len(chunk)
                        if size > MAX_FILE_BYTES:
                            raise InvalidArgument("file", f"is over {MAX_FILE_BYTES} bytes, the most a file may have")
                        spool.write(chunk)
                else:
                    await part.release()
            if filename is None:
                raise InvalidArgument("file", "is required")
            if purpose not in PURPOSES:
                raise InvalidArgument("purpose", f"must be one of {list(PURPOSES)}, got {purpose!r}")
            spool.seek(0)
            meta = FileObject(new_file_id(), 0, now_s(), filename, purpose, self.owner(request))
            meta = await asyncio.to_thread(self._store.write, meta, read_chunks(spool))
        return web.json_response(meta.to_openai())

    async def list(self, request: web.Request) -> web.Response:
        owner, purpose = self.owner(request), request.query.get("purpose")
        files = await asyncio.to_thread(self._store.list)
        data = [f.to_openai() for f in files if f.owner == owner and purpose in (None, f.purpose)]
        return web.json_response({"object": "list", "data": data, "has_more": False})

    async def retrieve(self, request: web.Request) -> web.Response:
        meta = await self.owned(request.match_info["file_id"], self.owner(request))
        return web.json_response(meta.to_openai())

    async def delete(self, request: web.Request) -> web.Response:
        meta = await self.owned(request.match_info["file_id"], self.owner(request))
        await asyncio.to_thread(self._store.delete, meta.id)
        return web.json_response({"id": meta.id, "object": "file", "deleted": True})

    async def content(self, request: web.Request) -> web.StreamResponse:
        meta = await self.owned(request.match_info["file_id"], self.owner(request))
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = meta.bytes
        source = await asyncio.to_thread(self._store.open, meta.id)
        try:
            await response.prepare(request)
            while chunk := await asyncio.to_thread(source.read, _READ_BYTES):
                await response.write(chunk)
        finally:
            source.close()
        await response.write_eof()
        return response


def _plausible(file_id: str) -> bool:
    """Whether `file_id` could name a file at all (never a path out of the store's folder)."""
    return file_id.startswith("file-") and file_id.replace("-", "").isalnum() and len(file_id) <= 64
