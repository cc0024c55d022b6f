"""What a newcomer meets first in ``kvferry profile`` / ``simulate`` /
``plan``: a poor profile fit is named and refused (unless
--allow-poor-fit), a plan that nothing meets says so with the nearest
placements and what they miss, rates print as given, files go where
--output says, and a served profile reports progress with an ETA."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.bench.profile import DECODE_TERMS, PREFILL_TERMS, fit, fit_quality, poor_fits
from kvferry.bench.profile_served import Progress
from tests.plan.helpers import profile_with_quality, write_profile


def kvferry(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # the tests' own kvferry, from any cwd
    return subprocess.run([sys.executable, "-m", "kvferry.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


SIM = ["--workload", "random", "--num-requests", "8", "--rate", "4", "--input-len", "32", "--output-len", "4"]


def test_a_poor_fit_is_refused_by_simulate_and_plan_unless_allowed(tmp_path):
    poor = profile_with_quality(tmp_path / "poor.json", prefill_r2=0.62, prefill_rms=0.18)
    for command, extra in (("simulate", []), ("plan", ["--slo", "ttft:1000", "--gpus", "1",
                                                       "--output", str(tmp_path / "out/")])):
        out = kvferry(command, "--profile", str(poor), *SIM, *extra)
        assert out.returncode == 2, out.stdout
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "prefill fit is poor (R² 0.62" in out.stderr and "18% (rms)" in out.stderr
        assert "the machine was busy; rerun on a quiet machine" in out.stderr and "--allow-poor-fit" in out.stderr
    allowed = kvferry("simulate", "--profile", str(poor), *SIM, "--json", "--allow-poor-fit")
    assert allowed.returncode == 0, allowed.stderr
    assert "WARNING" in allowed.stderr and "prefill fit is poor" in allowed.stderr
    assert json.loads(allowed.stdout)["summary"]["completed"] == 8
    # A flat decode fit: R² low (little variance to explain) but its points tight: not poor.
    flat = profile_with_quality(tmp_path / "flat.json", 0.999, 0.01, decode_r2=0.4, decode_rms=0.02)
    ok = kvferry("simulate", "--profile", str(flat), *SIM, "--json")
    assert ok.returncode == 0 and "poor" not in ok.stderr, ok.stderr


def test_profile_quality_names_a_poor_fit():
    """A prefill fit over points a busy machine scattered (R² < 0.9, 20%+
    off) gets the console line; clean points get none."""
    clean = [{"new": n, "cached": c, "time_s": 0.002 + 1e-4 * n + 1e-7 * n * c}
             for n in (16, 64, 128, 256) for c in (0, 256)]
    scattered = [dict(p, time_s=p["time_s"] * f) for p, f in zip(clean, (1.0, 1.9, 0.6, 1.7, 1.8, 0.5, 0.5, 1.8))]
    decode = [{"batch": b, "context": c, "time_s": 0.01 + 1e-3 * b} for b in (1, 4, 8) for c in (64, 256)]
    result = {"decode": {"points": decode, "fit": fit(decode, DECODE_TERMS)}}
    result["prefill"] = {"points": clean, "fit": fit(clean, PREFILL_TERMS)}
    assert poor_fits(result) == [] and fit_quality(result)["ok"]
    result["prefill"] = {"points": scattered, "fit": fit(scattered, PREFILL_TERMS)}
    assert result["prefill"]["fit"]["r2"] < 0.9
    (line,) = poor_fits(result)
    assert line.startswith("prefill fit is poor (R² ")
    assert line.endswith("the machine was busy; rerun on a quiet machine")
    assert line in fit_quality(result)["warnings"]


def test_plan_says_plainly_that_nothing_meets_the_slo_and_keeps_the_rate_as_given(tmp_path):
    """Prompts of 256 tokens at 2 ms a token: every TTFT is over 0.5 s, so a
    100 ms TTFT SLO is met by no placement; the plan names the nearest and
    their TTFT p90 against 100 ms. The rate prints as 8, though the sampled
    arrivals' own mean rate is not 8."""
    profile = write_profile(tmp_path / "p.json", (0.0, 0.002, 0, 0), (0.001, 0, 0))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = kvferry("plan", "--profile", str(profile), "--workload", "random", "--num-requests", "20", "--rate", "8",
                  "--input-len", "256", "--output-len", "4", "--slo", "ttft:100,tpot:50", "--gpus", "2",
                  "--output", str(tmp_path / "out"), cwd=cwd)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "no placement meets the SLO at 8 req/s (90% of requests within TTFT <= 100 ms, TPOT <= 50 ms)" in text
    nearest = text.split("nearest:")[1].splitlines()[1:4]
    assert len(nearest) == 3 and all("% within SLO: TTFT p90 " in line and "vs 100 ms" in line for line in nearest)
    # a decode instance's 1 ms steps meet the TPOT SLO: 1P1D misses on TTFT alone
    assert [line for line in nearest if line.strip().startswith("1P1D,") and "TPOT" not in line]
    assert "      best: " not in text and "requests at 8 req/s" in text
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["meets_slo"] is False and len(result["nearest"]) == 3
    assert result["rate"] == 8 and result["offered_rate"] != pytest.approx(8, abs=1e-3)
    assert all(c["at_target_ms"]["ttft"] > 500 for c in result["nearest"])
    # --output as a prefix: out.png and out.json, nothing in the working directory
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG" and list(cwd.iterdir()) == []
    assert f"wrote the plot to {tmp_path / 'out.png'} and the result to {tmp_path / 'out.json'}" in text


def test_plan_output_is_a_folder_or_a_default_printed_folder(tmp_path):
    profile = write_profile(tmp_path / "p.json", (0.0, 1e-5, 0, 0), (0.001, 0, 0))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    args = ["plan", "--profile", str(profile), *SIM, "--slo", "ttft:1000,tpot:100", "--gpus", "2"]
    folder = kvferry(*args, "--output", str(tmp_path / "runs") + os.sep, cwd=cwd)
    assert folder.returncode == 0, folder.stderr
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["plan.json", "plan.png"]
    assert list(cwd.iterdir()) == [] and "best: " in folder.stdout
    assert json.loads((tmp_path / "runs" / "plan.json").read_text())["meets_slo"] is True
    default = kvferry(*args, cwd=cwd)
    assert default.returncode == 0, default.stderr
    where = cwd / "kvferry-plan"
    assert sorted(p.name for p in where.iterdir()) == ["plan.json", "plan.png"]
    assert str(where / "plan.png") in default.stdout


def test_progress_lines_carry_elapsed_and_an_eta():
    now = [0.0]
    out = io.StringIO()
    p = Progress({"prefill": 4, "decode": 2, "first-token delay": 2}, {"first-token delay": 1.0}, out,
                 clock=lambda: now[0])
    now[0] = 2.0
    line = p.tick("prefill", "round 1/2 new 64 cached 0")
    # 3 prefill samples left at 2 s, 2 decode and 2 first-token pairs at the 2 s mean (+ 1 s of idle gap)
    assert line == "profile [  1/8] prefill round 1/2 new 64 cached 0: 2.0 s | elapsed 0:02 | ETA ~0:16"
    for t in (3.0, 4.0, 5.0):
        now[0] = t
        p.tick("prefill")
    now[0] = 15.0
    p.tick("decode")  # a decode burst of 10 s: the ETA follows the phase's own mean
    assert p.remaining_s() == pytest.approx(10 + 2 * (15 / 5 + 1.0))
    p.skip("first-token delay")
    assert p.total == 6 and p.remaining_s() == pytest.approx(10)
    assert out.getvalue().count("\n") == 5
