"""Tokenizer wrapper: chat templates as transformers renders them, and
streaming detokenization equal to a full decode."""
from __future__ import annotations

import json
import random

import pytest

from kvferry.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.tiny_models import write_tokenizer

MULTIBYTE = [
    "Hello 😀😃😄 world 🚀🌍!",
    "日本語のテキストです。東京は日本の首都です。",
    "中文文本，北京是中国的首都。café naïve 👍🏽 ❤️ Привет",
]


@pytest.fixture
def folder(tmp_path):
    write_tokenizer(tmp_path)
    return tmp_path


@pytest.fixture
def tok(folder):
    return Tokenizer(folder)


def test_basic_properties(tok):
    assert tok.vocab_size == 384
    assert tok.eos_token_ids == [2]
    assert tok.token_to_id("<|im_start|>") == 1
    ids = tok.encode("Paris is the capital")
    assert tok.decode(ids) == "Paris is the capital"
    assert tok.decode([1] + ids + [2]) == "Paris is the capital"
    assert tok.decode([1] + ids, skip_special_tokens=False).startswith("<|im_start|>")


def test_eos_ids_merge_generation_config(folder):
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert Tokenizer(folder).eos_token_ids == [0, 2]


def test_chat_template_matches_transformers(folder, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}]
    for gen in (True, False):
        ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
        assert ours == hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    assert ours.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_chat_template_features(folder):
    # trim_blocks / lstrip_blocks, raise_exception, tools, bos_token, tojson without HTML escaping
    template = (
        "{% if messages[0]['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}\n"
        "  {% for m in messages %}\n"
        "{{ bos_token }}[{{ m['role'] }}]{{ m['content'] }}\n"
        "  {% endfor %}\n"
        "{% if tools %}{{ tools | tojson }}{% endif %}"
    )
    (folder / "chat_template.jinja").write_text(template)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["bos_token"] = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(folder)
    out = tok.apply_chat_template([{"role": "user", "content": "a<b"}], tools=[{"name": "f<"}])
    assert out == '<|endoftext|>[user]a<b\n[{"name": "f<"}]'
    with pytest.raises(Exception, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])


def test_missing_template_is_clear(tmp_path):
    write_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer(tmp_path)


def _has_split_char(tok: Tokenizer, text: str) -> bool:
    """Some token of ``text`` decodes alone to an incomplete character."""
    return any("\ufffd" in tok.decode([i]) for i in tok.encode(text))


@pytest.mark.parametrize("text", MULTIBYTE)
def test_incremental_detokenizer_one_token_at_a_time(tok, text):
    assert _has_split_char(tok, text), "test text should split a UTF-8 character across tokens"
    prompt = tok.encode("Question: ")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.step([i]) for i in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.flush() == ""


@pytest.mark.parametrize("seed", range(3))
def test_incremental_detokenizer_random_chunks_and_specials(tok, seed):
    rng = random.Random(seed)
    ids = tok.encode(" ".join(MULTIBYTE)) + [2] + tok.encode(" 🚀 end")
    detok = IncrementalDetokenizer(tok, [])
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)  # speculative decoding appends several tokens per step
        out.append(detok.step(ids[i:i + n]))
        i += n
    out.append(detok.flush())
    assert "".join(out) == tok.decode(ids)


def test_incremental_detokenizer_window_stays_small(tok):
    ids = tok.encode("the cat sat on the mat " * 40)
    detok = IncrementalDetokenizer(tok, [])
    for i in ids:
        detok.step([i])
        assert detok.read_offset - detok.prefix_offset <= 4


def test_incremental_detokenizer_flushes_truncated_character(tok):
    emoji = tok.encode("😀")
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(tok, [])
    assert detok.step(emoji[:-1]) == ""  # held back: incomplete UTF-8
    assert detok.flush().endswith("\ufffd")


def _metaspace_byte_fallback_folder(path):
    """A sentencepiece-style BPE (Metaspace, byte fallback) whose longest
    token in bytes (日本日: 3 characters, 9 bytes) is shorter in characters
    than an ASCII piece (abababab) and the byte pieces (<0xE6>), with a
    non-ASCII added token."""
    from tokenizers import Tokenizer as HFTok, models, normalizers, pre_tokenizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ["\u2581", "a", "b", "日", "本", "ab", "abab", "abababab", "日本", "日本日"]:
        vocab[piece] = len(vocab)
    merges = [("a", "b"), ("ab", "ab"), ("abab", "abab"), ("日", "本"), ("日本", "日")]
    tok = HFTok(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.add_special_tokens(["終"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text("{}")
    return path


@pytest.mark.parametrize("kind", ["byte_level", "metaspace_byte_fallback"])
def test_the_character_bound_is_the_scan_over_every_token(tmp_path, kind):
    """The bound's longest token, found without a call per id, is the one
    a scan of every id finds; its spec is the one to_str() describes."""
    from kvferry.model.text_bound import max_chars_per_token

    if kind == "byte_level":
        write_tokenizer(tmp_path)
    else:
        _metaspace_byte_fallback_folder(tmp_path)
    tok = Tokenizer(tmp_path)
    scanned = max(len(tok.token_bytes(i)) for i in range(tok.vocab_size))
    assert kind == "byte_level" or scanned == 9  # 日本日
    assert tok._longest_token_bytes() == scanned
    full = json.loads(tok._tok.to_str())
    spec = tok._bound_spec()
    assert spec["pre_tokenizer"] == full["pre_tokenizer"] and spec["normalizer"] == full["normalizer"]
    assert spec["model"] == {"type": full["model"]["type"], "byte_fallback": bool(full["model"].get("byte_fallback"))}
    added = [t.content for t in tok._tok.get_added_tokens_decoder().values()]
    assert tok._max_chars_per_token() == max_chars_per_token(full, tok.vocab_size, tok.token_bytes, added)
    assert tok._max_chars_per_token() is not None
