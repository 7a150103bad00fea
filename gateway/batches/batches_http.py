"""OpenAI's Batch API over HTTP: create, retrieve, list and cancel batches; the batch workers (batch_svc) run them.

The routes read the request and write the answer; the checks, ownership and state changes are the
BatchService's, shared with the gRPC Batches service.
"""

from __future__ import annotations

from aiohttp import web

from gateway.batches.batch_service import LIST_LIMIT, BatchService, parse_batch_create
from gateway.batches.files_http import FilesApi
from gateway.http_api.request_body import json_body
from shardline.core.errors import InvalidArgument


class BatchesApi:
    """Routes of /v1/batches."""

    def __init__(self, service: BatchService, files_api: FilesApi) -> None:
        self._service = service
        self._files_api = files_api

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.list)
        app.router.add_get("/v1/batches/{batch_id}", self.retrieve)
        app.router.add_post("/v1/batches/{batch_id}/cancel", self.cancel)

    async def create(self, request: web.Request) -> web.Response:
        body = await json_body(request)  # the online endpoints' body reader: same limits, same errors
        record = await self._service.create_batch(self._files_api.owner(request), parse_batch_create(body))
        return web.json_response(record.to_openai())

    async def retrieve(self, request: web.Request) -> web.Response:
        record = await self._service.owned_batch(request.match_info["batch_id"], self._files_api.owner(request))
        return web.json_response(record.to_openai())

    async def list(self, request: web.Request) -> web.Response:
        least, most, default = LIST_LIMIT
        try:
            limit = int(request.query.get("limit", default))
        except ValueError:
            raise InvalidArgument("limit", f"must be an integer from {least} to {most}") from None
        owner = self._files_api.owner(request)
        records, more = await self._service.list_batches(owner, request.query.get("after"), limit)
        data = [r.to_openai() for r in records]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return web.json_response({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more})

    async def cancel(self, request: web.Request) -> web.Response:
        record = await self._service.cancel_batch(request.match_info["batch_id"], self._files_api.owner(request))
        return web.json_response(record.to_openai())
