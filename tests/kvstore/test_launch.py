"""The store's flags are the engine's: what ``kvstore.launch`` passes from a
KVTierConfig parses back to the same values, under the same names."""
from __future__ import annotations

import argparse

from kvferry.config import EngineArgs, KVTierConfig
from kvferry.kvstore.launch import store_argv
from kvferry.kvstore.process import add_kvstore_args


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_kvstore_args(parser)
    return parser.parse_args(argv)


def test_a_tier_config_round_trips_through_the_store_flags():
    tiers = KVTierConfig(kv_dram_gb=2.5, kv_disk="/tmp/ssd", kv_disk_gb=10.0, kv_remote="redis://127.0.0.1:6379/0")
    args = parse(store_argv(tiers, "ipc:///tmp/s.sock", block_nbytes=4096, api_keys="keys.json",
                            cache_secret_file="secret"))
    assert args.address == "ipc:///tmp/s.sock"
    for name in ("kv_dram_gb", "kv_disk", "kv_disk_gb", "kv_remote"):
        assert getattr(args, name) == getattr(tiers, name), name
    assert (args.block_nbytes, args.api_keys, args.cache_secret_file) == (4096, "keys.json", "secret")


def test_unset_tiers_pass_no_flag():
    argv = store_argv(KVTierConfig(kv_dram_gb=1.0), "ipc:///tmp/s.sock")
    assert argv == ["--address", "ipc:///tmp/s.sock", "--kv-dram-gb", "1.0"]
    args = parse(argv)
    assert args.kv_disk is None and args.kv_disk_gb is None and args.kv_remote is None


def test_the_store_flags_are_the_serve_flags_and_the_old_spellings_still_parse():
    serve = EngineArgs.add_cli_args(argparse.ArgumentParser())
    store = argparse.ArgumentParser()
    add_kvstore_args(store)
    serve_flags = {s for a in serve._actions for s in a.option_strings}
    store_flags = {s for a in store._actions for s in a.option_strings}
    assert {"--kv-dram-gb", "--kv-disk", "--kv-disk-gb", "--kv-remote"} <= serve_flags & store_flags
    old = parse(["--address", "ipc:///x", "--dram-gb", "1", "--disk", "/d", "--disk-gb", "2",
                 "--remote", "redis://h/0"])
    assert (old.kv_dram_gb, old.kv_disk, old.kv_disk_gb, old.kv_remote) == (1.0, "/d", 2.0, "redis://h/0")


def test_a_piped_secret_needs_its_parents_socket_secret_and_no_file(tmp_path):
    """``--cache-secret-fd`` (how a server hands its node stores its
    secret) refuses what would leave the store's tokens or secret unclear."""
    import os
    import subprocess
    import sys

    from kvferry import envs

    def run(extra: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        read_end, write_end = os.pipe()
        os.write(write_end, b"0123456789abcdef0123456789abcdef\n")
        os.close(write_end)
        try:
            return subprocess.run([sys.executable, "-m", "kvferry.kvstore.process", "--address",
                                   f"ipc://{tmp_path}/s.sock", "--kv-dram-gb", "0.01", "--cache-secret-fd",
                                   str(read_end), *extra], pass_fds=(read_end,), env=env, capture_output=True,
                                  text=True, timeout=60)
        finally:
            os.close(read_end)

    bare = {k: v for k, v in os.environ.items() if k != envs.SOCKET_SECRET}
    proc = run([], bare)
    assert proc.returncode == 2 and "cache_secret_fd" in proc.stderr and envs.SOCKET_SECRET in proc.stderr
    (tmp_path / "secret").write_bytes(b"0123456789abcdef0123456789abcdef")
    proc = run(["--cache-secret-file", str(tmp_path / "secret")], dict(bare, **{envs.SOCKET_SECRET: "ab" * 32}))
    assert proc.returncode == 2 and "give one or neither" in proc.stderr
