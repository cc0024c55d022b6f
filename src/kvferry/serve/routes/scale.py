"""The admin's scaling routes (with API keys, an admin key's only)::

    GET  /v1/admin/scale     each pool's count, the scale in progress, the last scales, the autoscaler's decisions
    POST /v1/admin/scale     {"engine": N} or {"prefill": N, "decode": M} (and "drain_timeout_s"): add or drain cores;
                             {"ffn": M} (with or without the others): --mode afd's FFN workers, resized first

The POST's counts have the keys of the GET's ``counts`` ("engines" is
accepted for "engine" too: the CLI's flag, and what the POST took first).
A POST returns when every new core serves and every removed one has
drained and stopped (``kvferry scale`` waits for it): 200, or 502 when a
core failed to start. 503 ``insufficient_resources`` when the cluster could
not place the new cores within --scale-timeout-s (nothing changed; the
message names what is missing), 503 ``server_shutting_down`` when the
server began to stop, 409 while another scale runs. An ``ffn`` count
resizes the server's FFN workers (serve/afd.py's resize_ffn) before any
core is added or drained, so that new cores start on the new workers; the
answer has ``"ffn": {"before", "after", "seconds"}``; 502 when the new
workers did not come up (the old ones still serve).
"""
from __future__ import annotations

from typing import Annotated

import anyio

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvferry.router.scaling import DEFAULT_DRAIN_TIMEOUT_S, ScaleInProgressError, ScaleStoppedError
from kvferry.serve.afd import resize_ffn
from kvferry.serve.engine_client import AsyncEngineClient
from kvferry.serve.errors import APIError, ErrorJSONResponse, bad_request
from kvferry.serve.routes.workers import admin_check
from kvferry.serve.serving import read_body
from kvferry.serve.tenants import ApiKeys


class _ScaleBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    engine: int | None = None
    engines: int | None = None  # the same count, as the CLI's --engines spells it
    prefill: int | None = None
    decode: int | None = None
    ffn: int | None = None  # --mode afd: FFN workers
    drain_timeout_s: Annotated[float, Field(ge=0, le=86400)] = DEFAULT_DRAIN_TIMEOUT_S


def _scale_body(body: bytes) -> _ScaleBody:
    try:
        return _ScaleBody.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise bad_request(f"expected a JSON object such as {{\"decode\": 2}}: {field or 'body'}: {first['msg']}",
                          field) from None


def scale_state(client: AsyncEngineClient) -> dict:
    """GET /v1/admin/scale's body (also the end of a POST's)."""
    scaler = client.scaler
    autoscaler = client.autoscaler
    return {
        "mode": client.router.mode,
        "counts": scaler.counts(),
        "scaling": scaler.busy,
        "target": scaler.target,
        "history": [event.to_json() for event in scaler.history],
        "autoscale": autoscaler.describe() if autoscaler is not None else None,
        "ffn_workers": client.ffn_pool.size if client.ffn_pool is not None else None,
    }


def scale_routes(client: AsyncEngineClient, keys: ApiKeys | None, max_body_bytes: int) -> list[Route]:
    require_admin = admin_check(keys)

    async def show(request: Request) -> Response:
        require_admin()
        return JSONResponse(scale_state(client))

    async def scale(request: Request) -> Response:
        require_admin()
        body = _scale_body(await read_body(request, max_body_bytes))
        if body.engine is not None and body.engines is not None:
            raise bad_request("give engine or engines (the same count), not both", "engines")
        engine, spelled = (body.engines, "engines") if body.engines is not None else (body.engine, "engine")
        target = {role: count for role, count in (("engine", engine), ("prefill", body.prefill),
                                                  ("decode", body.decode)) if count is not None}
        ffn = await _resize_ffn(client, body.ffn) if body.ffn is not None else None
        if ffn is not None and "error" in ffn:
            return ErrorJSONResponse({"ok": False, "ffn": ffn, "error": {
                "message": ffn["error"], "type": "service_unavailable_error", "param": "ffn",
                "code": "ffn_workers_failed"}}, status_code=502)
        if ffn is not None and not target:  # the FFN workers alone
            return JSONResponse({"ok": True, "ffn": ffn, "steps": [], "before": client.scaler.counts(),
                                 "after": client.scaler.counts(), "seconds": ffn["seconds"],
                                 "state": scale_state(client)})
        try:
            event = await client.scaler.scale(target, drain_timeout_s=body.drain_timeout_s,
                                              fields={"engine": spelled})
        except ValueError as exc:
            head = str(exc).partition(":")[0]
            raise bad_request(str(exc), head if head in ("engine", "engines", "prefill", "decode") else None) from None
        except ScaleInProgressError as exc:
            raise APIError(409, str(exc), code="scale_in_progress") from None
        except ScaleStoppedError as exc:
            raise APIError(503, str(exc), code="server_shutting_down") from None
        answer = event.to_json() | {"state": scale_state(client)} | ({"ffn": ffn} if ffn is not None else {})
        if event.error is not None:
            # The OpenAI-style error (for any client), with the event beside it.
            error = {"message": event.error, "type": "service_unavailable_error", "param": None,
                     "code": "insufficient_resources"}
            return ErrorJSONResponse(answer | {"error": error}, status_code=503)
        return JSONResponse(answer, status_code=200 if event.ok else 502)

    async def _resize_ffn(client: AsyncEngineClient, count: int) -> dict:
        """The FFN workers resized (a worker thread: they load their weights
        first); a bad count is a 400, a failed start an answer with "error"."""
        try:
            return await anyio.to_thread.run_sync(resize_ffn, client.ffn_pool, count)
        except ValueError as exc:
            raise bad_request(str(exc), "ffn") from None
        except RuntimeError as exc:
            return {"error": f"ffn: {exc}"}

    return [
        Route("/v1/admin/scale", show, methods=["GET"]),
        Route("/v1/admin/scale", scale, methods=["POST"]),
    ]
