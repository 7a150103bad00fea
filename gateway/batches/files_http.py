"""OpenAI's Files API over HTTP, for batch inputs and outputs: upload, list, read, download and delete.

The routes read the request and write the answer; the rules (purposes, sizes, ownership) are the
BatchService's, shared with the gRPC Batches service.
"""

from __future__ import annotations

import asyncio

from aiohttp import BodyPartReader, web

from gateway.batches.batch_service import BatchService, UploadSpool
from gateway.tenancy.auth import ApiKeys
from shardline.core.errors import InvalidArgument

# Bytes read from an upload, or sent of a download, at a time.
READ_BYTES = 1 << 20


class FilesApi:
    """Routes of /v1/files."""

    def __init__(self, service: BatchService, keys: ApiKeys) -> None:
        self._service = service
        self._keys = keys

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files", self.list)
        app.router.add_get("/v1/files/{file_id}", self.retrieve)
        app.router.add_delete("/v1/files/{file_id}", self.delete)
        app.router.add_get("/v1/files/{file_id}/content", self.content)

    def owner(self, request: web.Request) -> str:
        return self._keys.owner(request.headers.get("Authorization"))

    async def upload(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise InvalidArgument("file", "upload the file as multipart/form-data, with the fields file and purpose")
        purpose = filename = None
        with UploadSpool() as spool:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    raise InvalidArgument("file", "nested multipart bodies are not accepted")
                if part.name == "purpose":
                    purpose = (await part.text()).strip()
                elif part.name == "file":
                    filename = part.filename or "upload.jsonl"
                    while chunk := await part.read_chunk(READ_BYTES):
                        spool.write(chunk)
                else:
                    await part.release()
            meta = await self._service.save_file(self.owner(request), filename, purpose, spool)
        return web.json_response(meta.to_openai())

    async def list(self, request: web.Request) -> web.Response:
        files = await self._service.list_files(self.owner(request), request.query.get("purpose"))
        return web.json_response({"object": "list", "data": [f.to_openai() for f in files], "has_more": False})

    async def retrieve(self, request: web.Request) -> web.Response:
        meta = await self._service.owned_file(request.match_info["file_id"], self.owner(request))
        return web.json_response(meta.to_openai())

    async def delete(self, request: web.Request) -> web.Response:
        meta = await self._service.delete_file(request.match_info["file_id"], self.owner(request))
        return web.json_response({"id": meta.id, "object": "file", "deleted": True})

    async def content(self, request: web.Request) -> web.StreamResponse:
        meta, source = await self._service.open_file(request.match_info["file_id"], self.owner(request))
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = meta.bytes
        try:
            await response.prepare(request)
            while chunk := await asyncio.to_thread(source.read, READ_BYTES):
                await response.write(chunk)
        finally:
            source.close()
        await response.write_eof()
        return response
