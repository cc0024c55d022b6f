"""The --ray flags: parsed and checked before anything starts (a bad value is
one line naming the flag, exit 2), and ray is never imported without --ray."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvferry.fleet.placement import RayPlacement, actor_resources, parse_resources


def test_resources_parse_to_ray_actor_options():
    assert parse_resources('{"GPU": 1}', "--ray-decode-resources") == {"GPU": 1.0}
    assert actor_resources({"CPU": 2, "GPU": 1}) == {"num_cpus": 2, "num_gpus": 1}
    # A custom resource alone asks for no CPU: the node resource places it.
    assert actor_resources({"pnode": 1}) == {"num_cpus": 0.0, "num_gpus": 0.0, "resources": {"pnode": 1}}
    assert actor_resources({"CPU": 1, "memory": 2**30, "dnode": 0.5}) == {
        "num_cpus": 1, "num_gpus": 0.0, "memory": 2**30, "resources": {"dnode": 0.5}}
    placement = RayPlacement("10.0.0.1:6379", prefill_resources={"pnode": 1.0})
    assert placement.resources_of("prefill") == {"pnode": 1.0}
    assert placement.resources_of("decode") == placement.resources_of("engine") == {"CPU": 1.0}


@pytest.mark.parametrize("text, message", [
    ("{bad", "not JSON"),
    ("[1]", "must be a JSON object"),
    ("{}", "must be a JSON object"),
    ('{"GPU": -1}', "'GPU' must be a number >= 0"),
    ('{"GPU": "one"}', "'GPU' must be a number >= 0"),
    ('{"GPU": true}', "'GPU' must be a number >= 0"),
])
def test_bad_resources_name_the_flag(text, message):
    with pytest.raises(ValueError, match=f"--ray-prefill-resources: {message}"):
        parse_resources(text, "--ray-prefill-resources")


@pytest.mark.parametrize("address", ["", "http://head:6379", "head", "head:port", "a b:1"])
def test_a_bad_address_is_refused(address):
    with pytest.raises(ValueError, match="--ray: must be 'auto' or HOST:PORT"):
        RayPlacement(address)


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvferry.cli", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=120)


def test_serve_refuses_bad_ray_flags_before_starting_anything():
    out = _serve("--ray", "auto", "--mode", "disagg", "--ray-decode-resources", '{"GPU": -1}')
    assert out.returncode == 2 and "--ray-decode-resources: 'GPU' must be a number >= 0" in out.stderr, out.stderr
    # Nothing listens on port 1: refused at once, not after Ray's minutes of retries.
    out = _serve("--ray", "127.0.0.1:1")
    assert out.returncode == 2 and "--ray 127.0.0.1:1: no Ray cluster answers there" in out.stderr, out.stderr


def test_the_server_does_not_import_ray_without_the_flag():
    code = ("import sys, kvferry.serve.server, kvferry.router.supervisor, kvferry.fleet.placement; "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf"), True])
def test_a_bad_scale_timeout_is_refused(seconds):
    with pytest.raises(ValueError, match="--scale-timeout-s: must be a number of seconds > 0"):
        RayPlacement("auto", scale_timeout_s=seconds)
    assert RayPlacement("auto").scale_timeout_s == 60.0


def test_serve_refuses_a_bad_scale_timeout_in_one_line():
    out = _serve("--scale-timeout-s", "0")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "kvferry serve: error: --scale-timeout-s: must be a number of seconds > 0, got 0.0"], out.stderr
