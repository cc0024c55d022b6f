"""The /v1/kv routes (public prefixes, per-tenant cache stats, purges), and
the service that prefills a declaration.

    POST   /v1/kv/public_prefixes        {"prefix": text | [chat messages]}  (a publish key)
    GET    /v1/kv/public_prefixes        the caller's declarations (an admin's: every one)
    DELETE /v1/kv/public_prefixes/{id}   its owner or an admin
    GET    /v1/kv/stats                  the caller's prefix-cache counters (an admin's: every tenant's)
    DELETE /v1/kv/tenants/{tenant}       an admin: drop the tenant's unused cached blocks

Each publisher's declarations are its own: two publishers of the same text
hold two declarations (two ids, each ``"new"`` on its first declaration),
so an answer never tells whether someone else declared a prefix; the
matching trie holds the tokens while any declaration does.

Declaring a prefix prefills it at once, in the publisher's name: the
declaration's own request is the only one that ever writes public blocks
(``CacheScope.writes_public``), and the core holds them pinned while they
are declared. Every other tenant's request only reads them.

Deleting a declaration drops only its own blocks, on every live core, and
prefills nothing again. Prefixes share their leading blocks, so the front
end, which holds every declaration's tokens in a trie, counts the leading
blocks a remaining declaration still begins with; each core keys the rest
as the prefill did and unpins and drops them
(``EngineCoreDropPublicBlocks``, ``KVCacheManager.drop_public``)::

    kept      | k0 | k1 | k2 |            another declaration: still pinned, still hit
    deleted   | k0 | k1 | d2 | d3 |       d2, d3: unpinned, dropped (unless a running request reads them)

A core that is down meanwhile comes back with an empty device pool and is
prefilled with the declarations left then (``prefill_soon``). The node
store's tiers keep public blocks (no purge dropped them there); a deleted
prefix's are read again only through a declaration of the same tokens.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvferry.core.hashing import CacheScope
from kvferry.sampling import SamplingParams
from kvferry.serve.engine_client import AsyncEngineClient, EngineDeadError
from kvferry.serve.errors import APIError, bad_request
from kvferry.serve.public_prefixes import (
    Declaration, PublicPrefixRegistry, Registered, declaration_body, registration_body,
)
from kvferry.serve.serving import read_body
from kvferry.serve.tenants import ApiKeys, CacheNamespaces, add_tier_hit_rates, current_tenant, empty_tenant_stats

logger = logging.getLogger(__name__)


class _PrefixMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str


class PublicPrefixBody(BaseModel):
    """The registration body. pydantic's JSON parser bounds nesting and
    refuses lone surrogates, which json.loads lets through to the tokenizer."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prefix: Annotated[str, Field(min_length=1)] | Annotated[list[_PrefixMessage], Field(min_length=1)]


def parse_prefix_body(body: bytes) -> str | list[dict[str, str]]:
    try:
        prefix = PublicPrefixBody.model_validate_json(body).prefix
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        raise bad_request(f"expected a JSON object with a non-empty 'prefix' (a string or a list of "
                          f"chat messages): {first['msg']}", "prefix") from None
    return prefix if isinstance(prefix, str) else [m.model_dump() for m in prefix]


class PublicPrefixService:
    """Declarations of one server and their prefills."""

    def __init__(self, client: AsyncEngineClient, registry: PublicPrefixRegistry, namespaces: CacheNamespaces) -> None:
        self.client = client
        self.registry = registry
        self.namespaces = namespaces
        # One change at a time: the limits are checked against the set the
        # change will leave, and a purge must not race a prefill.
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()  # background prefills, held until done

    @property
    def prefixes(self):  # noqa: ANN201 - PublicPrefixes
        return self.registry.prefixes

    async def declare(self, item: Any, owner: str) -> tuple[Registered, bool]:
        """Register and prefill; ValueError names the field (PrefixLimitError
        past a limit). Returns the registration and whether the prefill ran."""
        token_ids = await asyncio.to_thread(self.registry.render, item, "prefix")
        async with self._lock:
            registered = self.prefixes.register(token_ids, owner)
            try:
                prefilled = await self._prefill(self.prefixes.declarations[registered.id])
            except EngineDeadError:
                if registered.new:  # nothing declared that was never computed
                    self.prefixes.remove(registered.id)
                raise
        return registered, prefilled

    async def delete(self, pid: str) -> Declaration:
        """KeyError for an unknown id. Every live core drops the blocks of
        this prefix that no remaining declaration shares (its leading
        blocks stay pinned while another prefix begins with them); nothing
        is prefilled again. Where a core cannot be told (EngineDeadError,
        TimeoutError), the declaration stays, for the caller to retry."""
        async with self._lock:
            declared = self.prefixes.remove(pid)
            bs = self.prefixes.block_size
            num_blocks = declared.num_tokens // bs
            first = self.prefixes.num_shared_blocks(declared.token_ids)
            if first < num_blocks:
                try:
                    await self.client.drop_public_blocks(self.namespaces.public,
                                                         list(declared.token_ids[:num_blocks * bs]), first)
                except (EngineDeadError, TimeoutError):
                    self.prefixes.restore(declared)
                    raise
        return declared

    async def prefill_all(self) -> int:
        """Prefill every declaration (the file's at start-up); returns how many ran."""
        async with self._lock:
            return sum([await self._prefill(d) for d in self.prefixes.of()])

    def prefill_soon(self) -> None:
        """prefill_all in the background (a core came back); failures are logged."""
        task = asyncio.get_running_loop().create_task(self.prefill_all())
        self._tasks.add(task)
        task.add_done_callback(self._prefilled)

    def _prefilled(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("public prefixes not prefilled again: %r", task.exception())

    async def _prefill(self, declared: Declaration) -> bool:
        """Compute the prefix's KV as the only writer of its public blocks
        (one token generated, discarded). False: shorter than a block,
        nothing to share."""
        num_blocks = declared.num_tokens // self.prefixes.block_size
        if not num_blocks:
            return False
        scope = CacheScope(self.namespaces.tenant(declared.owner), self.namespaces.public, num_blocks,
                           tenant=declared.owner, writes_public=True)
        stream = await self.client.add_request(f"public-prefix-{uuid.uuid4().hex}", list(declared.token_ids),
                                               SamplingParams(max_tokens=1, temperature=0.0), cache_scope=scope)
        try:
            async for _ in stream:
                pass
        finally:
            stream.close()
        return True


def public_prefix_routes(service: PublicPrefixService, max_body_bytes: int) -> list[Route]:
    block_size = service.prefixes.block_size

    async def register(request: Request) -> Response:
        tenant = current_tenant.get()
        if not tenant.publish:
            raise APIError(403, "this API key may not publish public prefixes", code="permission_denied")
        item = parse_prefix_body(await read_body(request, max_body_bytes))
        try:
            registered, prefilled = await service.declare(item, tenant.name)
        except ValueError as exc:
            raise bad_request(str(exc), "prefix") from None
        except EngineDeadError as exc:
            raise APIError(503, f"the prefix could not be prefilled: {exc}", code="engine_unavailable") from None
        # Only the caller's own count: the server's total would tell a
        # publisher how many prefixes the others declare.
        return JSONResponse(registration_body(registered, len(service.prefixes.of(tenant.name)), prefilled))

    async def list_prefixes(request: Request) -> Response:
        tenant = current_tenant.get()
        declared = service.prefixes.of(None if tenant.admin else tenant.name)
        return JSONResponse({"object": "list", "data": [declaration_body(d, block_size) for d in declared]})

    async def delete(request: Request) -> Response:
        tenant, pid = current_tenant.get(), request.path_params["prefix_id"]
        declared = service.prefixes.declarations.get(pid)
        # Another tenant's declaration answers as an unknown one: ids are not
        # secrets, but whether a prefix is declared by someone else is no
        # business of the caller's.
        if declared is None or not (tenant.admin or declared.owner == tenant.name):
            raise APIError(404, f"no public prefix {pid!r}", "prefix_id", code="not_found")
        try:
            await service.delete(pid)
        except KeyError:
            raise APIError(404, f"no public prefix {pid!r}", "prefix_id", code="not_found") from None
        except (EngineDeadError, TimeoutError) as exc:
            raise APIError(503, f"the prefix's public blocks could not be dropped: {exc}",
                           code="engine_unavailable") from None
        return JSONResponse({"object": "kv.public_prefix.deleted", "id": pid, "deleted": True})

    return [
        Route("/v1/kv/public_prefixes", register, methods=["POST"]),
        Route("/v1/kv/public_prefixes", list_prefixes, methods=["GET"]),
        Route("/v1/kv/public_prefixes/{prefix_id}", delete, methods=["DELETE"]),
    ]


def kv_tenant_routes(client: AsyncEngineClient, namespaces: CacheNamespaces, keys: ApiKeys | None) -> list[Route]:
    async def kv_stats(request: Request) -> Response:
        """Prefix-cache counters of the caller's tenant (every tenant's and
        the public pool's for an admin)."""
        tenant = current_tenant.get()
        stats = client.stats
        by_tenant, public = namespaces.split_stats(stats.prefix_by_owner)
        store = getattr(request.app.state, "kv_store", None)  # the server's own node store (server.py), if any
        add_tier_hit_rates(by_tenant, stats.kv_tier_tenants, store_up=store is None or store.health == "ok")
        if not tenant.admin:
            return JSONResponse({"object": "kv.stats",
                                 "tenants": {tenant.name: by_tenant.get(tenant.name, empty_tenant_stats())}})
        return JSONResponse({"object": "kv.stats", "tenants": by_tenant, "public": public})

    async def purge_tenant(request: Request) -> Response:
        """Admin: drop a tenant's unused cached blocks from the device pool now."""
        caller = current_tenant.get()
        if not caller.admin:
            raise APIError(403, "this API key may not purge tenants", code="permission_denied")
        name = request.path_params["tenant"]
        known = keys.tenant_names() if keys is not None else {caller.name}
        if name not in known and name not in client.stats.prefix_by_owner:
            raise APIError(404, f"unknown tenant {name!r}", code="tenant_not_found", param="tenant")
        try:
            purged = await client.purge_tenant(name)
        except TimeoutError:
            raise APIError(503, "the engine core did not answer the purge in time", code="engine_busy") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_unavailable") from None
        return JSONResponse({"object": "kv.tenant.purged", "tenant": name, "purged_blocks": purged})

    return [
        Route("/v1/kv/stats", kv_stats, methods=["GET"]),
        Route("/v1/kv/tenants/{tenant}", purge_tenant, methods=["DELETE"]),
    ]
