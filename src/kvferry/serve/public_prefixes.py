"""Declared public prefixes: the only KV shared across tenants.

    prefixes = PublicPrefixes(block_size)
    prefixes.register(token_ids)          -> Registered(num_tokens, num_blocks)
    prefixes.match(prompt_token_ids)      -> tokens of the longest registered prefix the prompt begins with
    render_prefix(item, tokenizer, template) -> token ids of a file / API item

An item is a string (a text prefix of completion prompts) or a list of chat
messages (a leading run of a conversation, rendered through the chat
template without a generation prompt). Matching is on token ids after
templating, with a trie, so a prompt matches only if its tokens really
begin with the prefix's tokens.

The policy (``CachePolicy``) then keys the blocks wholly inside the matched
prefix in the public namespace and every other block in the caller's own::

    prompt   | p p p p | p p p p | p p x x | x x x x |
    block    |   0     |   1     |   2     |   3     |
    scope    | public  | public  | private (holds a non-prefix token), and after

Only a declaration writes public blocks: registering a prefix prefills it,
in the publisher's name (``PublicPrefixService``). A tenant's request reads
public blocks that are cached and keeps everything it computes private (the
core drops it to its private chain when the public one is not cached in
full), so a publisher can never learn what another tenant sent.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvferry.core.hashing import CacheScope
from kvferry.model.tokenizer import PromptTooLong
from kvferry.serve.tenants import CacheNamespaces, Caller

MAX_PUBLIC_PREFIXES = 4096


@dataclass(frozen=True, slots=True)
class Registered:
    num_tokens: int
    num_blocks: int  # whole blocks inside the prefix: the part that is shared
    new: bool  # False: this owner declared the same prefix before (no one else's declaration shows)
    id: str = ""  # the declaration's id (DELETE /v1/kv/public_prefixes/{id})


@dataclass(frozen=True, slots=True)
class Declaration:
    """One declared public prefix and who declared it ("" for the operator's file)."""

    id: str
    owner: str
    token_ids: tuple[int, ...]
    created: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class PrefixLimits:
    """What public prefixes may hold. Public blocks are pinned in the device
    pool while declared, so the totals are bounded by a share of the pool."""

    max_prefixes: int = 4096  # on the server
    max_total_tokens: int | None = None  # on the server; None: no cap
    max_tokens_per_prefix: int | None = None  # None: no cap (the context length, by the server)
    max_prefixes_per_tenant: int = 64
    max_tokens_per_tenant: int = 65536

    def __post_init__(self) -> None:
        for name in ("max_prefixes", "max_prefixes_per_tenant", "max_tokens_per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class PrefixLimitError(ValueError):
    """A declaration past one of the PrefixLimits (a 400 naming ``prefix``)."""


def declaration_id(token_ids: list[int] | tuple[int, ...], owner: str = "") -> str:
    """One owner's declaration of one prefix. The owner is part of the id,
    so two publishers of the same text hold two declarations with two ids:
    neither the id nor ``new`` says whether another publisher declared it."""
    payload = json.dumps([owner, list(token_ids)]).encode()
    return f"pp-{hashlib.sha256(b'kvferry-public-prefix' + payload).hexdigest()[:24]}"


class _Node:
    __slots__ = ("children", "terminal")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.terminal = 0  # how many declarations end here


class TokenTrie:
    """Token-id sequences; ``longest_prefix_of(ids)`` is the length of the
    longest stored sequence that ``ids`` begins with (0 if none). A sequence
    inserted n times stays until removed n times (several publishers may
    declare the same prefix)."""

    def __init__(self) -> None:
        self._root = _Node()
        self.size = 0

    def insert(self, token_ids: list[int]) -> bool:
        """True when the sequence was not stored before."""
        node = self._root
        for t in token_ids:
            node = node.children.setdefault(t, _Node())
        node.terminal += 1
        if node.terminal > 1:
            return False
        self.size += 1
        return True

    def remove(self, token_ids: list[int] | tuple[int, ...]) -> bool:
        """Unregister one sequence (pruning nodes nothing else passes through)."""
        path = [self._root]
        for t in token_ids:
            node = path[-1].children.get(t)
            if node is None:
                return False
            path.append(node)
        if not path[-1].terminal:
            return False
        path[-1].terminal -= 1
        if path[-1].terminal:
            return True  # another declaration still holds it
        self.size -= 1
        for parent, t in zip(reversed(path[:-1]), reversed(list(token_ids))):
            child = parent.children[t]
            if child.terminal or child.children:
                break
            del parent.children[t]
        return True

    def shared_depth(self, token_ids: list[int] | tuple[int, ...]) -> int:
        """How many leading tokens of ``token_ids`` begin some stored
        sequence (nodes nothing passes through are pruned, so every node
        lies on a stored sequence)."""
        node = self._root
        for depth, t in enumerate(token_ids):
            node = node.children.get(t)
            if node is None:
                return depth
        return len(token_ids)

    def longest_prefix_of(self, token_ids: list[int]) -> int:
        node, best = self._root, 0
        for depth, t in enumerate(token_ids, start=1):
            node = node.children.get(t)
            if node is None:
                break
            if node.terminal:
                best = depth
        return best


class PublicPrefixes:
    def __init__(self, block_size: int, max_prefixes: int = MAX_PUBLIC_PREFIXES,
                 limits: PrefixLimits | None = None) -> None:
        self.block_size = block_size
        self.limits = limits or PrefixLimits(max_prefixes=max_prefixes)
        self.max_prefixes = self.limits.max_prefixes
        self._trie = TokenTrie()
        self.declarations: dict[str, Declaration] = {}  # by id, in declaration order

    def __len__(self) -> int:
        """The number of declarations (every owner's)."""
        return len(self.declarations)

    def register(self, token_ids: list[int], owner: str = "") -> Registered:
        """Declare a prefix in ``owner``'s name (PrefixLimitError past a limit).
        The same tokens declared again by the same owner are the same
        declaration. Each owner's declarations are its own record: whether
        another owner declared the same tokens changes neither the answer
        nor the limits (each declaration counts in full), so a publisher
        learns nothing about the others' declarations."""
        if not token_ids:
            raise ValueError("prefix: renders to no tokens")
        pid = declaration_id(token_ids, owner)
        if pid in self.declarations:
            return Registered(len(token_ids), len(token_ids) // self.block_size, False, pid)
        self._check_limits(len(token_ids), owner)
        self._trie.insert(list(token_ids))
        self.declarations[pid] = Declaration(pid, owner, tuple(token_ids), int(time.time()))
        return Registered(len(token_ids), len(token_ids) // self.block_size, True, pid)

    def remove(self, pid: str) -> Declaration:
        """KeyError for an unknown id."""
        declared = self.declarations.pop(pid)
        self._trie.remove(declared.token_ids)
        return declared

    def num_shared_blocks(self, token_ids: list[int] | tuple[int, ...]) -> int:
        """How many leading whole blocks of ``token_ids`` some declaration
        holds too: a block's key chains every token before its end, so a
        declaration shares a block exactly when it begins with the tokens up
        to that block's end."""
        return self._trie.shared_depth(token_ids) // self.block_size

    def restore(self, declared: Declaration) -> None:
        """Declare ``declared`` again as it was (its deletion failed)."""
        if declared.id not in self.declarations:
            self._trie.insert(list(declared.token_ids))
            self.declarations[declared.id] = declared

    def of(self, owner: str | None = None) -> list[Declaration]:
        """Every declaration (None), or those of one owner."""
        return [d for d in self.declarations.values() if owner is None or d.owner == owner]

    def _check_limits(self, num_tokens: int, owner: str) -> None:
        lim, mine = self.limits, self.of(owner)
        if lim.max_tokens_per_prefix is not None and num_tokens > lim.max_tokens_per_prefix:
            raise PrefixLimitError(f"prefix: renders to {num_tokens} tokens, more than the "
                                   f"{lim.max_tokens_per_prefix} a public prefix may hold on this server")
        if len(self.declarations) >= lim.max_prefixes:
            raise PrefixLimitError(f"prefix: the server already holds {lim.max_prefixes} public prefixes")
        if len(mine) >= lim.max_prefixes_per_tenant:
            raise PrefixLimitError(f"prefix: this tenant already holds {lim.max_prefixes_per_tenant} public prefixes")
        if sum(d.num_tokens for d in mine) + num_tokens > lim.max_tokens_per_tenant:
            raise PrefixLimitError(f"prefix: this tenant's public prefixes would hold more than "
                                   f"{lim.max_tokens_per_tenant} tokens")
        total = sum(d.num_tokens for d in self.declarations.values()) + num_tokens
        if lim.max_total_tokens is not None and total > lim.max_total_tokens:
            raise PrefixLimitError(f"prefix: the server's public prefixes would hold more than "
                                   f"{lim.max_total_tokens} tokens (a share of the KV cache)")

    def match(self, token_ids: list[int]) -> int:
        return self._trie.longest_prefix_of(token_ids)


class CachePolicy:
    """The server's cache scope for one caller's prompt: the tenant's private
    namespace (narrowed by its cache salt, if any), its quota and weight,
    plus the whole blocks of a matched public prefix."""

    def __init__(self, namespaces: CacheNamespaces, prefixes: PublicPrefixes) -> None:
        self.namespaces = namespaces
        self.prefixes = prefixes

    def scope(self, caller: Caller, token_ids: list[int]) -> CacheScope:
        tenant = caller.tenant
        namespace = self.namespaces.tenant(tenant.name, caller.cache_salt)
        num_public_blocks = self.prefixes.match(token_ids) // self.prefixes.block_size
        public = self.namespaces.public if num_public_blocks else ""
        return CacheScope(namespace, public, num_public_blocks, tenant.quota_device_blocks,
                          tenant=tenant.name, tenant_weight=tenant.weight)


# ---- items: text or chat messages -> token ids ------------------------------

def render_prefix(item: Any, tokenizer: Any, chat_template: str | None = None, where: str = "prefix",
                  max_chars: int | None = None) -> list[int]:
    """Token ids of one item, exactly as the completions / chat endpoints
    would tokenize the start of a prompt. ValueError names the field (text
    past ``max_chars`` cannot fit the context: refused before encoding)."""
    checked = check_item(item, where)
    try:
        if isinstance(checked, str):
            return tokenizer.encode(checked, max_chars=max_chars)
        # As the chat endpoint encodes messages: special-token text typed in
        # their content stays plain text (the server's default).
        return tokenizer.encode_chat(checked, add_generation_prompt=False, chat_template=chat_template,
                                     max_chars=max_chars)
    except PromptTooLong as exc:
        raise ValueError(f"{where}: {exc}") from None


def check_item(item: Any, where: str = "prefix") -> str | list[dict[str, str]]:
    """A prefix item, validated (no tokenizer needed: also run at start-up
    before the model loads)."""
    if isinstance(item, str) and item:
        return item
    if isinstance(item, list) and item:
        return [_message(m, f"{where}[{i}]") for i, m in enumerate(item)]
    raise ValueError(f"{where}: must be a non-empty string or a non-empty list of chat messages")


def _message(m: Any, where: str) -> dict[str, str]:
    if not isinstance(m, dict) or set(m) != {"role", "content"}:
        raise ValueError(f"{where}: a message must be an object with exactly 'role' and 'content'")
    if m["role"] not in ("system", "developer", "user", "assistant"):
        raise ValueError(f"{where}.role: must be system, developer, user or assistant")
    if not isinstance(m["content"], str):
        raise ValueError(f"{where}.content: must be a string")
    return {"role": m["role"], "content": m["content"]}


def load_prefix_file(path: str | Path, register: Callable[[Any, str], Any] = check_item) -> list[Any]:
    """Register every item of a --public-prefixes file (a JSON list)."""
    try:
        items = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"public_prefixes: cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"public_prefixes: {path} is not valid JSON: {exc}") from None
    if not isinstance(items, list):
        raise ValueError("public_prefixes: the file must hold a JSON list of prefixes")
    return [register(item, f"public_prefixes[{i}]") for i, item in enumerate(items)]


# ---- the server's side: files, the registration route -------------------------

class PublicPrefixRegistry:
    """Public prefixes of one server: rendered with its tokenizer and chat
    template, matched by its cache policy."""

    def __init__(self, prefixes: PublicPrefixes, tokenizer: Any, chat_template: str | None = None,
                 max_chars: int | None = None) -> None:
        self.prefixes = prefixes
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_chars = max_chars  # longer text cannot fit the context (Tokenizer.max_prompt_chars)

    def render(self, item: Any, where: str = "prefix") -> list[int]:
        return render_prefix(item, self.tokenizer, self.chat_template, where, self.max_chars)

    def register(self, item: Any, where: str = "prefix", owner: str = "") -> Registered:
        return self.prefixes.register(self.render(item, where), owner)

    def load_file(self, path: str | Path) -> list[Registered]:
        return load_prefix_file(path, self.register)


def registration_body(registered: Registered, total: int, prefilled: bool = False) -> dict[str, Any]:
    """``total``: the caller's own declarations (never the server's, which
    would count the other publishers')."""
    return {"object": "kv.public_prefix", "id": registered.id, "num_tokens": registered.num_tokens,
            "num_blocks": registered.num_blocks, "new": registered.new, "prefilled": prefilled,
            "num_public_prefixes": total}


def declaration_body(declared: Declaration, block_size: int) -> dict[str, Any]:
    return {"object": "kv.public_prefix", "id": declared.id, "owner": declared.owner,
            "num_tokens": declared.num_tokens, "num_blocks": declared.num_tokens // block_size,
            "created": declared.created}
