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
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvferry.core.hashing import CacheScope
from kvferry.serve.tenants import CacheNamespaces, current_cache_salt, current_tenant

MAX_PUBLIC_PREFIXES = 4096


@dataclass(frozen=True, slots=True)
class Registered:
    num_tokens: int
    num_blocks: int  # whole blocks inside the prefix: the part that is shared
    new: bool  # False: the same prefix was registered before


class _Node:
    __slots__ = ("children", "terminal")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.terminal = False


class TokenTrie:
    """Token-id sequences; ``longest_prefix_of(ids)`` is the length of the
    longest stored sequence that ``ids`` begins with (0 if none)."""

    def __init__(self) -> None:
        self._root = _Node()
        self.size = 0

    def insert(self, token_ids: list[int]) -> bool:
        node = self._root
        for t in token_ids:
            node = node.children.setdefault(t, _Node())
        if node.terminal:
            return False
        node.terminal = True
        self.size += 1
        return True

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
    def __init__(self, block_size: int, max_prefixes: int = MAX_PUBLIC_PREFIXES) -> None:
        self.block_size = block_size
        self.max_prefixes = max_prefixes
        self._trie = TokenTrie()

    def __len__(self) -> int:
        return self._trie.size

    def register(self, token_ids: list[int]) -> Registered:
        if not token_ids:
            raise ValueError("prefix: renders to no tokens")
        if len(self) >= self.max_prefixes:
            raise ValueError(f"prefix: the server already holds {self.max_prefixes} public prefixes")
        new = self._trie.insert(list(token_ids))
        return Registered(len(token_ids), len(token_ids) // self.block_size, new)

    def match(self, token_ids: list[int]) -> int:
        return self._trie.longest_prefix_of(token_ids)


class CachePolicy:
    """The server's cache scope for a prompt of the current request's tenant:
    private namespace (narrowed by its cache salt, if any) plus the whole
    blocks of a matched public prefix."""

    def __init__(self, namespaces: CacheNamespaces, prefixes: PublicPrefixes) -> None:
        self.namespaces = namespaces
        self.prefixes = prefixes

    def __call__(self, token_ids: list[int]) -> CacheScope:
        tenant = current_tenant.get()
        namespace = self.namespaces.tenant(tenant.name, current_cache_salt.get())
        num_public_blocks = self.prefixes.match(token_ids) // self.prefixes.block_size
        public = self.namespaces.public if num_public_blocks else ""
        return CacheScope(namespace, public, num_public_blocks, tenant.quota_device_blocks,
                          tenant=tenant.name, tenant_weight=tenant.weight)


# ---- items: text or chat messages -> token ids ------------------------------

def render_prefix(item: Any, tokenizer: Any, chat_template: str | None = None, where: str = "prefix") -> list[int]:
    """Token ids of one item, exactly as the completions / chat endpoints
    would tokenize the start of a prompt. ValueError names the field."""
    checked = check_item(item, where)
    if isinstance(checked, str):
        return tokenizer.encode(checked)
    text = tokenizer.apply_chat_template(checked, add_generation_prompt=False, chat_template=chat_template)
    return tokenizer.encode(text, add_special_tokens=False)


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

    def __init__(self, prefixes: PublicPrefixes, tokenizer: Any, chat_template: str | None = None) -> None:
        self.prefixes = prefixes
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def register(self, item: Any, where: str = "prefix") -> Registered:
        return self.prefixes.register(render_prefix(item, self.tokenizer, self.chat_template, where))

    def load_file(self, path: str | Path) -> list[Registered]:
        return load_prefix_file(path, self.register)


def registration_body(registered: Registered, total: int) -> dict[str, Any]:
    return {"object": "kv.public_prefix", "num_tokens": registered.num_tokens,
            "num_blocks": registered.num_blocks, "new": registered.new, "num_public_prefixes": total}
