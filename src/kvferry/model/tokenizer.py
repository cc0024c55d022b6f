"""Tokenizer: ``tokenizers.Tokenizer`` + HF chat templates + streaming detokenization.

Loaded from a model folder holding tokenizer.json and (optionally)
tokenizer_config.json, chat_template.jinja, config.json and
generation_config.json. No transformers import: serving processes stay light.
"""
from __future__ import annotations

import json
import re
import secrets
import threading
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kvferry.model.text_bound import max_chars_per_token


class PromptTooLong(ValueError):
    """Text with more characters than any prompt that fits the context can
    hold (``model.text_bound``): refused before it is encoded."""

    def __init__(self, num_chars: int, max_chars: int) -> None:
        super().__init__(f"the text has {num_chars} characters, more than the {max_chars} that fit the context")
        self.num_chars = num_chars
        self.max_chars = max_chars


def _check_chars(text: str, max_chars: int | None) -> None:
    if max_chars is not None and len(text) > max_chars:
        raise PromptTooLong(len(text), max_chars)


def _ids(tok: HFTokenizer, text: str, add_special_tokens: bool) -> Any:
    """The Encoding of ``text``. ``encode_batch``, not ``encode``: only the
    batch call releases the GIL while it works, so a long text encoded on a
    worker thread does not stall the event loop (one 1.9 MiB prompt held
    the GIL for 3 s with ``encode``)."""
    return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]


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
        # The decoder's own JSON, not the whole tokenizer's: serializing and
        # parsing a 49k-entry vocabulary cost ~65 ms of every process's start.
        decoder = self._tok.decoder
        self._byte_level = _uses_byte_level_decoder(None if decoder is None else json.loads(decoder.__getstate__()))
        self._content_guard = _ContentGuard(
            [t.content for i, t in self._tok.get_added_tokens_decoder().items() if i in self.special_token_ids])
        self._plain_lock = threading.Lock()
        self._plain_tok: dict[bool, HFTokenizer] = {}  # at_start -> a copy that reads special tokens as text

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, max_chars: int | None = None) -> list[int]:
        """Token ids of ``text``. Pass ``add_special_tokens=False`` for text
        rendered by the chat template: it already holds its BOS / role tokens.
        ``max_chars``: PromptTooLong, without encoding, for longer text."""
        _check_chars(text, max_chars)
        return _ids(self._tok, text, add_special_tokens).ids

    def max_prompt_chars(self, max_model_len: int) -> int | None:
        """The most characters a text of ``max_model_len`` tokens can have
        (None where the tokenizer gives no honest bound: model.text_bound)."""
        per_token = self._max_chars_per_token()
        return None if per_token is None else max_model_len * per_token

    def _max_chars_per_token(self) -> int | None:
        # Computed once, on first use (a pass over the vocabulary); a race
        # computes the same value twice.
        if not hasattr(self, "_chars_per_token"):
            added = [t.content for t in self._tok.get_added_tokens_decoder().values()]
            self._chars_per_token = max_chars_per_token(self._bound_spec(), self.vocab_size, self.token_bytes, added,
                                                        self._longest_token_bytes)
        return self._chars_per_token

    def _bound_spec(self) -> dict[str, Any]:
        """What text_bound reads of the tokenizer's JSON: the model's type
        and byte fallback, the pre-tokenizer and the normalizer. Not
        ``to_str()``: serializing and parsing the whole vocabulary and merges
        took ~0.1 s of every server's start, after its core was ready."""
        model = self._tok.model
        spec: dict[str, Any] = {"model": {"type": type(model).__name__,
                                          "byte_fallback": bool(getattr(model, "byte_fallback", False))}}
        for key, part in (("pre_tokenizer", self._tok.pre_tokenizer), ("normalizer", self._tok.normalizer)):
            spec[key] = None if part is None else json.loads(part.__getstate__())
        return spec

    def _longest_token_bytes(self) -> int:
        """``max(len(self.token_bytes(i)) for i in range(self.vocab_size))``
        without a call per id (~0.1 s for a 49k vocabulary): the added
        tokens exactly, then the model's pieces longest first, each bounding
        its bytes (a byte-level piece has one character per byte; any other
        character is at most 4 bytes of UTF-8), until no piece left can beat
        the longest found."""
        longest = max((len(self.token_bytes(i)) for i in self._added_token_ids if i < self.vocab_size), default=0)
        per_char = 1 if self._byte_level else 4
        vocab = self._tok.get_vocab(with_added_tokens=False)
        for piece in sorted(vocab, key=len, reverse=True):
            if len(piece) * per_char <= longest:
                break
            if (i := vocab[piece]) < self.vocab_size and i not in self._added_token_ids:
                longest = max(longest, len(self.token_bytes(i)))
        return max(longest, 1)

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

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        special_tokens_in_content: bool = False,
        max_chars: int | None = None,
    ) -> list[int]:
        """Token ids of a rendered conversation, with the template's own
        special tokens (role markers, BOS) as special ids and, unless
        ``special_tokens_in_content``, special-token text that came from the
        messages or tools (a user typing ``<|im_start|>``) as plain text.

        Encoding the rendered string in one go cannot tell the two apart:
        by then a typed ``<|im_start|>`` is the same characters as the
        template's. So every request string is first scanned; where one
        holds special-token text (or ends or starts with a piece of one,
        which could join a neighbouring string into a whole one), that text
        is swapped for a random sentinel before rendering. Every special
        token left in the rendered text is then the template's; the spans
        between them that hold a sentinel are encoded, sentinels restored,
        with special tokens read as text. A template could branch on the
        content or change it (upper-case it, say), so the sentinel rendering
        must give back exactly the real rendering once restored, or this
        raises ValueError rather than guess. Requests whose strings hold no
        such text (nearly all) take one render and one encode, as before.
        ``max_chars``: PromptTooLong, before any encoding, when the rendered
        conversation is longer."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, chat_template)
        _check_chars(text, max_chars)
        if special_tokens_in_content:
            return self.encode(text, add_special_tokens=False)
        swap = self._content_guard.swap()
        guarded_messages, guarded_tools = swap.protect(messages), swap.protect(tools)
        if not swap.originals:  # no request string holds special-token text
            return self.encode(text, add_special_tokens=False)
        guarded = self.apply_chat_template(guarded_messages, add_generation_prompt, guarded_tools, chat_template)
        if swap.restore(guarded) != text:
            raise ValueError("this chat template changes message text that holds special-token text, so the "
                             "server cannot keep that text plain; remove the special tokens from the messages")
        encoding = _ids(self._tok, guarded, add_special_tokens=False)
        ids: list[int] = []
        prev_index, prev_end = -1, 0
        boundaries = [(k, start, end) for k, (tid, (start, end)) in enumerate(zip(encoding.ids, encoding.offsets))
                      if tid in self.special_token_ids]
        # Each span between two of the template's special tokens is a hard
        # boundary in the one-go encoding too, so re-encoding one span alone
        # leaves every other token as it was.
        for index, start, end in [*boundaries, (len(encoding.ids), len(guarded), len(guarded))]:
            span = guarded[prev_end:start]
            if swap.holds_sentinel(span):
                ids += _ids(self._plain(at_start=prev_end == 0), swap.restore(span), add_special_tokens=False).ids
            else:
                ids += encoding.ids[prev_index + 1:index]
            if index < len(encoding.ids):
                ids.append(encoding.ids[index])
            prev_index, prev_end = index, end
        return ids

    def _plain(self, at_start: bool) -> HFTokenizer:
        """A copy of the tokenizer that encodes special-token text as plain
        text. A span encoded alone starts at offset 0, where a sentencepiece
        pre-tokenizer with prepend_scheme "first" adds its leading "▁";
        inside the full text it would not, so spans that are not at the
        start use a copy that never prepends."""
        with self._plain_lock:
            tok = self._plain_tok.get(at_start)
            if tok is None:
                spec = json.loads(self._tok.to_str())
                if not at_start:
                    _never_prepend(spec.get("pre_tokenizer"))
                tok = HFTokenizer.from_str(json.dumps(spec))
                tok.encode_special_tokens = True
                self._plain_tok[at_start] = tok
            return tok

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


# ---- special-token text in request strings ----

class _ContentGuard:
    """The special-token strings of one tokenizer, and the pieces of them
    (proper prefixes and suffixes) that a string's end or start could
    contribute to a whole one next to another string."""

    def __init__(self, specials: list[str]) -> None:
        specials = sorted({s for s in specials if s}, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.prefixes = {s[:k] for s in specials for k in range(1, len(s))}
        self.suffixes = {s[k:] for s in specials for k in range(1, len(s))}
        self.longest = max(map(len, specials), default=0)

    def swap(self) -> "_Swap":
        return _Swap(self)


class _Swap:
    """One request's sentinels: ``kvf<nonce>s<n>z``, letters and digits
    only, so they pass a template's string filters (tojson, trim)
    unchanged; the random nonce makes them unguessable, so no request text
    can pass for one."""

    def __init__(self, guard: _ContentGuard) -> None:
        self.guard = guard
        self.nonce = secrets.token_hex(8)
        self.sentinel = re.compile(f"kvf{self.nonce}s(\\d+)z")
        self.originals: list[str] = []

    def protect(self, value: Any) -> Any:
        """``value`` (messages, tools: JSON-like) with sentinels swapped in."""
        if isinstance(value, str):
            return self._protect_str(value)
        if isinstance(value, dict):
            return {self.protect(k): self.protect(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.protect(v) for v in value]
        return value

    def _protect_str(self, text: str) -> str:
        guard = self.guard
        if guard.pattern is None:
            return text
        text = guard.pattern.sub(lambda m: self._sentinel(m.group(0)), text)
        # A piece of a special token at either end (whitespace aside, which
        # templates often trim) could complete one with what the template
        # puts next to it.
        core_end = len(text.rstrip())
        for k in range(min(guard.longest - 1, core_end), 0, -1):
            if text[core_end - k:core_end] in guard.prefixes:
                text = text[:core_end - k] + self._sentinel(text[core_end - k:core_end]) + text[core_end:]
                break
        core_start = len(text) - len(text.lstrip())
        for k in range(min(guard.longest - 1, len(text) - core_start), 0, -1):
            if text[core_start:core_start + k] in guard.suffixes:
                text = text[:core_start] + self._sentinel(text[core_start:core_start + k]) + text[core_start + k:]
                break
        return text

    def _sentinel(self, original: str) -> str:
        self.originals.append(original)
        return f"kvf{self.nonce}s{len(self.originals) - 1}z"

    def holds_sentinel(self, text: str) -> bool:
        return self.sentinel.search(text) is not None

    def restore(self, text: str) -> str:
        return self.sentinel.sub(lambda m: self.originals[int(m.group(1))], text)


def _never_prepend(pre_tokenizer: dict[str, Any] | None) -> None:
    if not pre_tokenizer:
        return
    if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
        pre_tokenizer["prepend_scheme"] = "never"
    for inner in pre_tokenizer.get("pretokenizers") or []:
        _never_prepend(inner)


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
