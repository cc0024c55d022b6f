"""``kvferry profile --url`` against a real disaggregated server (1 prefill
+ 1 decode core): it measures host sharing instead of a mixed-step fit, its
step noise holds real prefill samples only, and ``kvferry simulate``
applies the sharing only to instances placed on one host.

Tiny prompts: the numbers checked are structure and bounds, not speeds."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from kvferry.bench.profile_served import noise_ratios
from kvferry.cli import main
from kvferry.plan.latency import StepCostModel


@pytest.fixture(scope="module")
def disagg(disagg_server):
    """The session's disaggregated server (conftest.py), at 1 prefill + 1
    decode core (a no-op scale, unless a test scaled it before this one)."""
    r = httpx.post(f"{disagg_server.base_url}/v1/admin/scale", json={"prefill": 1, "decode": 1}, timeout=600)
    assert r.status_code == 200 and r.json()["after"] == {"prefill": 1, "decode": 1}, r.text
    return disagg_server


def test_disagg_profile_measures_host_sharing_and_simulate_applies_it(disagg, tmp_path, capsys):
    out = tmp_path / "disagg.json"
    code = main(["profile", "--url", disagg.base_url, "--new-tokens", "8,24", "--cached-tokens", "0,16",
                 "--batch-sizes", "1,2", "--context-lens", "8,24", "--decode-steps", "2", "--repeats", "1",
                 "--idle-gap", "0.1", "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    assert "host sharing" in capsys.readouterr().out
    data = json.loads(out.read_text())
    # the decode core never prefills: no mixed fit, and the probes went to host sharing
    assert data["mixed"]["points"] == [] and data["mixed"]["fit"]["coef"] == [0.0, 0.0, 0.0]
    sharing = data["host_sharing"]
    assert sharing["prefill"] >= 1.0 and sharing["decode"] >= 1.0 and sharing["prefill_ratios"]
    # step noise: the prefill samples' ratios alone, none from the probes' decode gaps
    assert data["step_noise"]["prefill"] == noise_ratios(data["prefill"]["points"], data["prefill"]["fit"])
    assert len(data["step_noise"]["prefill_at_s"]) == len(data["step_noise"]["prefill"])
    cost = StepCostModel.from_profile(str(out))
    assert (cost.host_sharing.prefill, cost.host_sharing.decode) == (sharing["prefill"], sharing["decode"])

    # a slowdown the simulation can see: requests every 50 ms beside long decodes
    data["host_sharing"].update(prefill=2.0, decode=1.5)
    out.write_text(json.dumps(data))

    def simulate(*extra: str) -> dict:
        res = subprocess.run([sys.executable, "-m", "kvferry.cli", "simulate", "--profile", str(out), "--workload",
                              "random", "--rate", "20", "--num-requests", "20", "--input-len", "64",
                              "--output-len", "16", "--noise-seeds", "1", "--config", "prefill:1,decode:1", "--json",
                              "--allow-poor-fit", *extra],  # a 4-point toy profile: its fit may be poor
                             capture_output=True, text=True, check=True)
        return json.loads(res.stdout)["summary"]

    apart, shared = simulate(), simulate("--instances-per-host", "2")
    assert shared["ttft_ms"]["p50"] > apart["ttft_ms"]["p50"]
    # The mean, not the median: how many decode steps overlap a prefill on
    # the shared host depends on the measured prefill times, and on a quiet
    # minute the median request's decodes may overlap none.
    assert shared["tpot_ms"]["mean"] > apart["tpot_ms"]["mean"]
