"""Many concurrent streams through the real client, all complete."""
from __future__ import annotations

import asyncio

import openai
import pytest

from tests.serve.server_process import MODEL_NAME

pytestmark = pytest.mark.usefixtures("healthy")

NUM_STREAMS = 64
MAX_TOKENS = 12


async def _one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
    text, finish, usage = "", None, 0
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": f"Say something about the number {i}."}],
        max_tokens=MAX_TOKENS, temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
    )
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return text, finish, usage


async def _all(base_url: str):
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
        return await asyncio.gather(*(_one(client, i) for i in range(NUM_STREAMS)))


def test_64_concurrent_streams(server):
    results = asyncio.run(_all(server.api_url))
    assert len(results) == NUM_STREAMS
    for text, finish, usage in results:
        assert finish in ("stop", "length")
        assert 1 <= usage <= MAX_TOKENS
        assert finish == "stop" or usage == MAX_TOKENS
    assert server.wait_for_metric("kvferry:kv_blocks_used", lambda v: v == 0, timeout_s=10) == 0
