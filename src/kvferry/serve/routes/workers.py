"""The admin's worker routes (with API keys, an admin key's only)::

    GET    /v1/admin/workers                   every worker and its state
    POST   /v1/admin/workers                   {"address": "tcp://HOST:PORT", "role": "engine"}: join a running core
    DELETE /v1/admin/workers/{name or address}, or DELETE /v1/admin/workers with {"address": ...}
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvferry.engine.core_client import EngineCoreStartError
from kvferry.serve.engine_client import AsyncEngineClient
from kvferry.serve.errors import APIError, bad_request
from kvferry.serve.serving import read_body
from kvferry.serve.tenants import ApiKeys, current_tenant
from kvferry.serve.worker_address import WorkerUnreachable, check_worker_address, probe_worker


class _WorkerBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    address: Annotated[str, Field(min_length=1, max_length=1024)]
    role: Annotated[str, Field(max_length=16)] = "engine"


def _worker_body(body: bytes) -> _WorkerBody:
    """pydantic's JSON parser bounds nesting (json.loads recursed until a
    RecursionError, a 500) and refuses lone surrogates."""
    try:
        return _WorkerBody.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        raise bad_request(f"expected a JSON object with a string 'address' (and 'role'): {first['msg']}",
                          "address") from None


def admin_check(keys: ApiKeys | None) -> Callable[[], None]:
    """A check that the caller's key is an admin's (403 otherwise)."""
    def require_admin() -> None:
        # Without a key file there is one tenant, and it runs the server.
        if keys is not None and not current_tenant.get().admin:
            raise APIError(403, "this API key may not manage workers", code="permission_denied")

    return require_admin


def worker_routes(client: AsyncEngineClient, keys: ApiKeys | None, max_body_bytes: int) -> list[Route]:
    require_admin = admin_check(keys)

    async def list_workers(request: Request) -> Response:
        require_admin()
        return JSONResponse({"object": "list", "data": client.describe_workers()})

    async def join_worker(request: Request) -> Response:
        require_admin()
        item = _worker_body(await read_body(request, max_body_bytes))
        address, role = item.address, item.role
        try:
            # At once, not after the join's handshake timeout: a malformed
            # address or a path that is no socket is a 400, and a peer that
            # is not there or does not speak ZeroMQ a 502 within seconds.
            await probe_worker(check_worker_address(address))
            worker = await client.join_worker(address, role)
        except ValueError as exc:
            raise bad_request(str(exc), "role" if str(exc).startswith("role") else "address") from None
        except (EngineCoreStartError, WorkerUnreachable) as exc:
            raise APIError(502, f"could not join the worker at {address!r}: {exc}", "address",
                           code="worker_unreachable") from None
        return JSONResponse(worker.describe(client.index.num_blocks(worker.name)))

    async def remove_worker(request: Request) -> Response:
        require_admin()
        target = request.path_params.get("name")
        if target is None:
            target = _worker_body(await read_body(request, max_body_bytes)).address
        try:
            worker = await client.leave_worker(str(target))
        except KeyError:
            raise APIError(404, f"no worker named or at {target!r}", "address", code="not_found") from None
        except ValueError as exc:
            raise APIError(409, str(exc), "address", code="last_worker") from None
        return JSONResponse({"name": worker.name, "address": worker.address, "removed": True})

    return [
        Route("/v1/admin/workers", list_workers, methods=["GET"]),
        Route("/v1/admin/workers", join_worker, methods=["POST"]),
        Route("/v1/admin/workers", remove_worker, methods=["DELETE"]),
        Route("/v1/admin/workers/{name:path}", remove_worker, methods=["DELETE"]),
    ]
