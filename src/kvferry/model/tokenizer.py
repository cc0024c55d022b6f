"""Tokenizer: ``tokenizers.Tokenizer`` + HF chat templates + streaming detokenization.

Loaded from a model folder holding tokenizer.json and (optionally)
tokenizer_config.json, chat_template.jinja, config.json and
generation_config.json. No transformers import: serving processes stay light.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    """Encode/decode and chat-template rendering for one model folder."""

    def __init__(self, path: str | Path) -> None:
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"tokenizer.json not found in {folder}")
        self._tok = HFTokenizer.from_file(str(tok_file))
        self._config = _read_json(folder / "tokenizer_config.json")
        self.chat_template: str | None = _chat_template(folder, self._config)
        self.bos_token: str | None = _token_str(self._config.get("bos_token"))
        self.eos_token: str | None = _token_str(self._config.get("eos_token"))
        self.bos_token_id: int | None = self._bos_id(folder)
        self.eos_token_ids: list[int] = self._eos_ids(folder)
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )
        self._added_token_ids = frozenset(self._tok.get_added_tokens_decoder())
        self._byte_level = _uses_byte_level_decoder(json.loads(self._tok.to_str()).get("decoder"))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Pass ``add_special_tokens=False`` for text
        rendered by the chat template: it already holds its BOS / role tokens."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for, so that a token holding part
        of a UTF-8 character (an emoji split over tokens) still has its real
        bytes, where decoding it alone gives U+FFFD. Concatenating the bytes
        of a sequence's tokens rebuilds its text."""
        if token_id in self._added_token_ids:
            return self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:  # GPT-2 style: each byte is mapped to one printable character
            return bytes(_UNICODE_TO_BYTE[c] for c in piece if c in _UNICODE_TO_BYTE)
        if (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:  # sentencepiece "<0xF0>"
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # sentencepiece marks spaces with U+2581

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` as transformers' ``apply_chat_template(tokenize=False)`` does.
        ``chat_template`` replaces the model's own (a server's --chat-template,
        or a tool-capable template for a model whose own has no tools)."""
        source = chat_template or self.chat_template
        if not source:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json chat_template "
                             "or chat_template.jinja); send a plain prompt instead")
        template = _compile_template(source)
        return template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    # ---- special ids ----

    def _bos_id(self, folder: Path) -> int | None:
        if self.bos_token is not None:
            return self._tok.token_to_id(self.bos_token)
        bos = _read_json(folder / "config.json").get("bos_token_id")
        return int(bos) if isinstance(bos, int) else None

    def _eos_ids(self, folder: Path) -> list[int]:
        """Union of every place a checkpoint states its stop ids, in order:
        generation_config (what HF generate stops on), config, tokenizer_config."""
        ids: list[int] = []
        for source in (_read_json(folder / "generation_config.json"), _read_json(folder / "config.json")):
            ids += _as_ids(source.get("eos_token_id"))
        if self.eos_token is not None and (tid := self._tok.token_to_id(self.eos_token)) is not None:
            ids.append(tid)
        return list(dict.fromkeys(ids))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, per request.

    Decodes only a small window: ``ids[prefix_offset:read_offset]`` is text
    already emitted (kept as context, because byte-level and sentencepiece
    tokens decode differently at the start of a string), and
    ``ids[read_offset:]`` is new. Text that ends in U+FFFD is an incomplete
    UTF-8 character split across tokens: it is held back until complete.
    Same scheme as vLLM's ``detokenize_incrementally``.
    """

    # How many prompt tokens seed the context window.
    INITIAL_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - self.INITIAL_CONTEXT, 0)
        self.text = ""  # everything emitted so far

    def step(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (possibly "")."""
        self.ids.extend(new_token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: whatever is held back (an invalid or
        truncated UTF-8 tail), replacement characters included."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.ids))
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)


# ---- chat templates, as transformers compiles them ----

class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers in
    some templates): rendered as its body, as transformers does when not
    tracking masks."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# ---- token bytes ----

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to
    themselves, the other 68 to code points from 256 upwards, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    mapping = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()


def _uses_byte_level_decoder(decoder: dict[str, Any] | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level_decoder(d) for d in decoder.get("decoders") or [])


# ---- small file helpers ----

def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _token_str(value: Any) -> str | None:
    """Special tokens are saved as plain strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]
