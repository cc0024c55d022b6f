"""Deleting a public prefix drops its own blocks only, through a real server.

Prefixes share their leading blocks: deleting one declaration must leave
every block another declaration begins with pinned and hit, drop the rest
(no public hit on them for anyone), and prefill nothing again. The
publisher's prefix-cache queries (GET /v1/kv/stats, counted when a request
of the publisher's, a declaration's prefill included, is admitted) tell
whether anything was prefilled.
"""
from __future__ import annotations

import json
import os
import signal
import time
import uuid

import httpx
import pytest

from tests.serve.server_process import ServerProcess, start_server
from tests.serve.test_core_process import core_pid, wait_healthy
from tests.tenants.conftest import BLOCK_SIZE, make_client

MODEL = "SmolLM2-135M-Instruct"
KEYS = {
    "sk-pub": {"tenant": "pub", "publish": True},
    "sk-reader": {"tenant": "reader"},
    "sk-admin": {"tenant": "ops", "admin": True},
}
# Ends in a newline so that the tails start new tokens: the declarations
# share the blocks wholly inside it, token for token.
COMMON = ("Standing orders for every support desk of Example Corp, read before each conversation: "
          "greet the customer, confirm the account, never read a password aloud, log the ticket.\n")


def tail(word: str) -> str:
    return " ".join(f"Desk {word} rule {i}: escalate outages to the {word} team at once." for i in range(4))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    d = tmp_path_factory.mktemp("prefixdel")
    (d / "keys.json").write_text(json.dumps(KEYS))
    # A node KV store beside the device pool: a deleted prefix's own blocks
    # must leave it too.
    srv = start_server(d / "server.log", ["--api-keys", str(d / "keys.json"), "--block-size", str(BLOCK_SIZE),
                                          "--kv-dram-gb", "0.1"])
    yield srv
    code = srv.stop()
    assert code == 0, f"server exit code {code}:\n{srv.log()[-5000:]}"


def declare(server: ServerProcess, prefix: str) -> dict:
    r = httpx.post(f"{server.base_url}/v1/kv/public_prefixes", json={"prefix": prefix},
                   headers={"Authorization": "Bearer sk-pub"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["prefilled"], r.text
    return r.json()


def delete(server: ServerProcess, prefix_id: str) -> httpx.Response:
    return httpx.delete(f"{server.base_url}/v1/kv/public_prefixes/{prefix_id}",
                        headers={"Authorization": "Bearer sk-pub"}, timeout=120)


def stats(server: ServerProcess) -> tuple[int, int]:
    """(the publisher's prefix-cache queries, the public pool's cached blocks)."""
    r = httpx.get(f"{server.base_url}/v1/kv/stats", headers={"Authorization": "Bearer sk-admin"}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["tenants"].get("pub", {}).get("prefix_cache_queries", 0), body["public"]["cached_blocks"]


def cached_tokens(server: ServerProcess, prompt: str) -> int:
    """A reader's request in a namespace of its own (a fresh cache salt):
    only public blocks can hit."""
    with make_client(server, "sk-reader") as reader:
        r = reader.completions.create(model=MODEL, prompt=f"{prompt} Question {uuid.uuid4().hex}?", max_tokens=1,
                                      temperature=0, extra_body={"cache_salt": uuid.uuid4().hex})
    return r.usage.prompt_tokens_details.cached_tokens


def test_deleting_one_of_two_prefixes_keeps_the_shared_blocks_and_prefills_nothing(server):
    word = uuid.uuid4().hex[:6]
    kept, gone = declare(server, COMMON + tail(f"a{word}")), declare(server, COMMON + tail(f"b{word}"))
    queries, public_blocks = stats(server)
    assert delete(server, gone["id"]).status_code == 200
    # The survivor's blocks stay cached and pinned: it is hit whole, nothing
    # was prefilled again (the publisher's queries did not move).
    assert cached_tokens(server, COMMON + tail(f"a{word}")) == kept["num_blocks"] * BLOCK_SIZE
    after_queries, after_blocks = stats(server)
    assert after_queries == queries, "the delete prefilled a declaration again"
    # Exactly the deleted one's own blocks are gone: its tail is no public hit.
    assert after_blocks == kept["num_blocks"] < public_blocks
    assert cached_tokens(server, COMMON + tail(f"b{word}")) == 0
    assert delete(server, kept["id"]).status_code == 200
    assert delete(server, kept["id"]).status_code == 404  # deleted twice


def test_deleting_every_prefix_one_by_one_leaves_no_public_block_and_prefills_nothing(server):
    word = uuid.uuid4().hex[:6]
    texts = [COMMON + tail(f"{i}{word}") for i in range(3)]
    declared = [declare(server, text) for text in texts]
    queries, _ = stats(server)
    for i, d in enumerate(declared):
        assert delete(server, d["id"]).status_code == 200
        if i + 1 < len(declared):  # the next one is still hit whole
            assert cached_tokens(server, texts[i + 1]) == declared[i + 1]["num_blocks"] * BLOCK_SIZE
        assert cached_tokens(server, texts[i]) == 0
    assert stats(server) == (queries, 0)


def store_counters(server: ServerProcess) -> tuple[float, float]:
    """(tokens loaded from the node's KV store, blocks ordered saved to it)."""
    text = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": "Bearer sk-admin"}, timeout=30).text
    values = {}
    for line in text.splitlines():
        for name in ("kvferry:kv_store_loaded_tokens_total", "kvferry:kv_store_saved_blocks_total"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values.get("kvferry:kv_store_loaded_tokens_total", 0.0), values.get("kvferry:kv_store_saved_blocks_total", 0.0)


def test_a_deleted_prefixs_own_blocks_leave_the_node_store(server):
    """Declared again after its delete, a prefix's own blocks are computed
    again (and saved again), not loaded from the node's KV store: the delete
    dropped them there too."""
    word = uuid.uuid4().hex[:6]
    kept, gone = declare(server, COMMON + tail(f"s{word}")), declare(server, COMMON + tail(f"t{word}"))
    assert delete(server, gone["id"]).status_code == 200
    loaded, saved = store_counters(server)
    again = declare(server, COMMON + tail(f"t{word}"))
    deadline = time.monotonic() + 30
    while (now := store_counters(server))[1] <= saved:  # the re-declaration's saves are reported
        assert time.monotonic() < deadline, f"no new block saved to the store: {now}, {server.log()[-3000:]}"
        time.sleep(0.2)
    assert now[0] == loaded, "the deleted prefix's blocks were loaded back from the node store"
    for d in (kept, again):
        assert delete(server, d["id"]).status_code == 200
    assert stats(server)[1] == 0


def test_a_prefix_deleted_while_its_core_restarts_is_not_served_when_it_is_back(server):
    """The last test of this module: it kills the server's core."""
    word = uuid.uuid4().hex[:6]
    kept, gone = declare(server, COMMON + tail(f"k{word}")), declare(server, COMMON + tail(f"g{word}"))
    core = core_pid(server.proc.pid)
    os.kill(core, signal.SIGKILL)
    # The core is down (or about to be found so): the delete still succeeds.
    assert delete(server, gone["id"]).status_code == 200, server.log()[-3000:]
    assert core_pid(server.proc.pid, timeout_s=180, other_than=core) != core
    assert wait_healthy(server.base_url, 180).status_code == 200, server.log()[-3000:]
    deadline = time.monotonic() + 60
    while cached_tokens(server, COMMON + tail(f"k{word}")) != kept["num_blocks"] * BLOCK_SIZE:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.5)
    # The new core was prefilled with the survivor only.
    assert stats(server)[1] == kept["num_blocks"]
    assert cached_tokens(server, COMMON + tail(f"g{word}")) == 0
    assert delete(server, kept["id"]).status_code == 200
    assert stats(server)[1] == 0
