"""The KV store's tiers under restarts and faults, through a real
``kvferry serve`` (which starts the store process), the real ``openai``
client, real files and real signals:

* the SSD tier survives a server restart without ``--cache-secret-file``
  (the secret is kept beside the tier's data);
* a store SIGKILLed under a load costs the request a recompute within a
  step or two, not a long timeout, and the server keeps serving (in
  test_kv_tiers_serve.py, on that module's server of the same flags).
"""
from __future__ import annotations

import stat
import subprocess

import openai

from tests.serve.server_process import MODEL_NAME, start_server

BLOCK = 16
# ~370 tokens: 23 blocks of 16, several times what the tiny DRAM tiers
# below hold, so its blocks end up on the SSD.
LONG_PROMPT = "The lighthouse keeper wrote in his log every night about ships, storms and gulls. " * 20
FLUSH_PROMPT = "A market street in the morning: bread, apples, cheese, fish and flowers for sale. " * 20


def _complete(client: openai.OpenAI, prompt: str, max_tokens: int = 8):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)


def _cached(response) -> int:
    details = response.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


def _kvstore_pid(server_pid: int) -> int:
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(server_pid)], capture_output=True, text=True).stdout
    pids = [int(line.split()[0]) for line in out.splitlines() if "kvferry: kvstore" in line]
    assert len(pids) == 1, f"expected one kvstore child of the server, found: {out!r}"
    return pids[0]


def test_the_disk_tier_survives_a_restart_without_a_secret_file(tmp_path):
    disk = tmp_path / "ssd"
    # DRAM of 14 blocks (0.01 GiB of ~0.7 MB blocks): the long prompt and
    # the flush push the long prompt's blocks down to the SSD.
    args = ["--kv-dram-gb", "0.01", "--kv-disk", str(disk), "--kv-disk-gb", "1",
            "--num-kv-blocks", "64", "--block-size", str(BLOCK)]
    first = start_server(tmp_path / "first.log", args)
    try:
        client = openai.OpenAI(base_url=first.api_url, api_key="x")
        before = _complete(client, LONG_PROMPT)
        assert before.usage.prompt_tokens > 300
        _complete(client, FLUSH_PROMPT)
    finally:
        # SIGTERM: the store finishes its write-backs before it exits.
        code = first.stop()
    assert code == 0, first.log()[-5000:]
    secret = disk / "cache-secret"
    assert secret.is_file(), first.log()[-5000:]
    # Only the owner may read the key to every tenant's blocks at rest.
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    notes = [line for line in first.log().splitlines() if str(secret) in line]
    assert len(notes) == 1 and "generated" in notes[0], first.log()[-5000:]
    kept = secret.read_bytes()

    second = start_server(tmp_path / "second.log", args)
    try:
        client = openai.OpenAI(base_url=second.api_url, api_key="x")
        after = _complete(client, LONG_PROMPT)
        # A fresh device pool and DRAM arena: only the SSD can hold these
        # (the leading blocks the flush evicted from DRAM: 14 here; 0
        # when a restart changed the secret).
        assert _cached(after) >= 8 * BLOCK, second.log()[-5000:]
        assert after.choices[0].text == before.choices[0].text
        assert second.wait_for_metric("kvferry:kv_tier_hits_total", lambda v: v > 0, tier="disk") > 0
    finally:
        code = second.stop()
    assert code == 0, second.log()[-5000:]
    assert secret.read_bytes() == kept  # reused, not replaced
    assert [line for line in second.log().splitlines() if str(secret) in line and "using" in line]
