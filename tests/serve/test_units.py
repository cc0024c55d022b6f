"""Small pure pieces of the server: edge checks, naming, chunk merging."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.routing import Route

from kvferry.core.outputs import TokenLogprobs
from kvferry.model.tokenizer import Tokenizer
from kvferry.outputs import CompletionOutput, RequestOutput
from kvferry.serve.api_flags import ApiOptions
from kvferry.serve.errors import EXCEPTION_HANDLERS, APIError, error_response
from kvferry.serve.logprobs import completion_logprobs
from kvferry.serve.params import named_field, resolve_max_tokens
from kvferry.serve.protocol import CompletionRequest, DeltaMessage
from kvferry.serve.server import default_model_name
from kvferry.serve.serving import RequestIds, _validation_error, merge_deltas
from tests.tiny_models import write_tokenizer


def test_resolve_max_tokens():
    assert resolve_max_tokens(None, 10, 100, "prompt") == 90  # up to the context
    assert resolve_max_tokens(90, 10, 100, "prompt") == 90
    with pytest.raises(APIError) as e:
        resolve_max_tokens(91, 10, 100, "prompt")
    assert e.value.status == 400 and e.value.param == "max_tokens" and "101 tokens" in e.value.message
    with pytest.raises(APIError) as e:
        resolve_max_tokens(1, 100, 100, "messages")
    assert e.value.param == "messages"
    with pytest.raises(APIError) as e:
        resolve_max_tokens(0, 1, 100, "prompt")
    assert e.value.param == "max_tokens"


def test_named_field():
    assert named_field("top_p must be in (0, 1], got 2") == "top_p"
    assert named_field("prompt token id 5 is outside") is None


def test_default_model_name():
    assert default_model_name(None) == "SmolLM2-135M-Instruct"
    assert default_model_name("/models/Qwen3-0.6B/") == "Qwen3-0.6B"
    assert default_model_name("/m/tiny.Q4_0.gguf") == "tiny.Q4_0"


def test_validation_error_names_the_field_not_the_union_member():
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", "stop": [1]})
    err = _validation_error(e.value)
    assert err.param.startswith("stop") and "str" not in err.param.split(".")


def test_delta_message_omits_absent_fields():
    assert json.loads(DeltaMessage().model_dump_json()) == {}
    assert json.loads(DeltaMessage(role="assistant", content="").model_dump_json()) == {"role": "assistant", "content": ""}


def _out(index, text, tokens, finished=False, reason=None):
    return RequestOutput("r", None, [1], [CompletionOutput(index, "", [], reason)], finished,
                         new_token_ids=tokens, new_text=text)


def test_merge_deltas_coalesces_per_sequence():
    deltas = merge_deltas([_out(0, "a", [1]), _out(1, "x", [2]), _out(0, "b", [3], True, "length")])
    by_index = {d.index: d for d in deltas}
    assert by_index[0].text == "ab" and by_index[0].num_tokens == 2 and by_index[0].finish_reason == "length"
    assert by_index[1].text == "x" and by_index[1].finish_reason is None


def test_completion_logprobs_offsets_and_clamping():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return {1: "ab", 2: "c"}[ids[0]]

    from kvferry.serve.logprobs import TokenStrings

    entries = [TokenLogprobs(1, -0.1, 1, [1, 2], [-0.1, float("-inf")]), TokenLogprobs(2, -1.0, 2, [1], [-0.5])]
    lp = completion_logprobs(entries, TokenStrings(Tok()), text_offset=5)
    assert lp.tokens == ["ab", "c"] and lp.text_offset == [5, 7]
    assert lp.top_logprobs[0] == {"ab": -0.1, "c": -9999.0}
    assert lp.top_logprobs[1] == {"ab": -0.5, "c": -1.0}  # the sampled token is always listed


def test_http_side_does_not_import_torch():
    """The app, protocol and engine client stay torch-free, so a router
    process in front of remote engines can run them without torch."""
    import subprocess
    import sys

    code = "import sys, kvferry.serve.app, kvferry.serve.server; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- errors, token bytes, options, ids -------------------------------------------

TEXTS = ["Hello 😀😃 world 🚀!", "日本語 café naïve", " Привет 👍🏽"]


async def _crash(request):
    raise RuntimeError("a bug")


def test_500_closes_connection():
    app = Starlette(routes=[Route("/boom", _crash)], exception_handlers=EXCEPTION_HANDLERS)

    async def get():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.get("/boom")

    r = asyncio.run(get())
    assert r.status_code == 500
    assert r.headers["connection"] == "close"  # our state is suspect: do not reuse the connection
    assert r.json()["error"]["type"] == "internal_server_error"


def test_error_body_renders_any_string():
    # An error echoing a lone surrogate must still render (as an escape).
    response = error_response(404, "The model `\ud800` does not exist.", param="model")
    assert json.loads(response.body)["error"]["message"] == "The model `\ud800` does not exist."
    assert response.body.isascii()
    assert "connection" not in response.headers


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_byte_level(tmp_path, text):
    write_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.token_bytes(tok.token_to_id("<|im_end|>")) == b"<|im_end|>"


def _sentencepiece_folder(tmp_path):
    """A Llama-2 style tokenizer: U+2581 for spaces, <0xNN> byte fallback."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ["\u2581", "\u2581H", "e", "l", "o", "\u2581w", "r", "d", "!", "\u2581c", "a", "f", "é"]:
        vocab.setdefault(piece, len(vocab))
    model = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    tok = HFTokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_token_bytes_sentencepiece_byte_fallback(tmp_path):
    tok = Tokenizer(_sentencepiece_folder(tmp_path))
    ids = tok.encode("Hello world! café 😀", add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"\xf0" in pieces  # the emoji came out as byte-fallback tokens
    assert tok.decode([ids[-1]]) != "😀"  # alone, a byte token decodes to U+FFFD
    assert b"".join(pieces) == " Hello world! café 😀".encode("utf-8")  # the leading U+2581 is a space


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens_default": 0}, "max_tokens_default"),
    ({"max_tokens_limit": -1}, "max_tokens_limit"),
    ({"max_tokens_default": 10, "max_tokens_limit": 5}, "max_tokens_default"),
    ({"header_read_timeout_s": 0}, "header_read_timeout_s"),
    ({"keep_alive_timeout_s": -1}, "keep_alive_timeout_s"),
    ({"max_header_count": 0}, "max_header_count"),
    ({"tool_call_parser": "nope"}, "tool_call_parser"),
    ({"responses_store_size": 0}, "responses_store_size"),
])
def test_api_options_validated(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ApiOptions(**kwargs)


def test_request_ids():
    a, b = RequestIds.make("chatcmpl", "same"), RequestIds.make("chatcmpl", "same")
    assert a.public == b.public == "chatcmpl-same"
    assert a.engine != b.engine and a.engine.startswith("chatcmpl-same-")
    c = RequestIds.make("resp", None, sep="_")
    assert c.public == c.engine and c.public.startswith("resp_")
