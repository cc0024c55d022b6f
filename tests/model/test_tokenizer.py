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
