"""What ``kvferry plan`` prints and draws: the table says how many
placements it leaves out and why, a plan that nothing meets says so in the
figure instead of drawing empty bars, and the instance is named by the
profile's device (a CPU profile's instances are not GPUs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvferry.plan.search import TABLE_ROWS, plan_figure
from tests.plan.helpers import write_profile

SIM = ["--workload", "random", "--num-requests", "8", "--rate", "4", "--input-len", "32", "--output-len", "4"]


def _plan(tmp_path: Path, profile: Path, slo: str, gpus: int) -> tuple[str, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-m", "kvferry.cli", "plan", "--profile", str(profile), *SIM,
                          "--slo", slo, "--gpus", str(gpus), "--output", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"
    return out.stdout, json.loads((tmp_path / "out.json").read_text())


def _cpu_profile(tmp_path: Path, prefill: tuple = (0.0, 1e-5, 0, 0)) -> Path:
    path = write_profile(tmp_path / "cpu.json", prefill, (0.001, 0, 0))
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "device": "cpu", "threads": 2}))  # as `kvferry profile` writes it
    return path


def test_the_table_counts_what_it_leaves_out_and_a_cpu_profile_counts_cpu_instances(tmp_path):
    # 6 colocated counts + 15 prefill/decode splits of at most 6 instances: 21 placements
    text, result = _plan(tmp_path, _cpu_profile(tmp_path), "ttft:1000,tpot:100", 6)
    assert len(result["candidates"]) == 21 and result["meets_slo"]
    rows = [line for line in text.splitlines() if line.strip().split(" ")[0].rstrip("CPD0123456789") == ""
            and line.strip()[:1].isdigit()]
    assert len(rows) == TABLE_ROWS, text
    assert f"({21 - TABLE_ROWS} of 21 placements not shown: they rank below these; the JSON lists every one)" in text
    assert "up to 6 CPU instances" in text and "CPU inst" in text.splitlines()[1] and "per CPU instance" in text
    assert "GPU" not in text, text
    assert result["device_unit"]["plural"] == "CPU instances" and result["hardware"][0]["device"] == "cpu"
    fig = plan_figure(result)
    [ax] = fig.axes
    assert ax.get_ylabel() == "goodput per CPU instance (req/s)"
    assert "up to 6 CPU instances" in ax.get_title() and "GPU" not in ax.get_title()


def test_a_profile_that_names_no_device_counts_devices_and_a_short_table_drops_nothing(tmp_path):
    profile = write_profile(tmp_path / "p.json", (0.0, 1e-5, 0, 0), (0.001, 0, 0))
    text, result = _plan(tmp_path, profile, "ttft:1000,tpot:100", 2)
    assert len(result["candidates"]) == 3 and "not shown" not in text
    assert "up to 2 devices" in text and "per device" in text and "GPU" not in text


def test_nothing_meets_the_slo_the_figure_says_so_instead_of_bars(tmp_path):
    # 32-token prompts at 2 ms a token: every TTFT is over 60 ms, the SLO 10 ms
    text, result = _plan(tmp_path, _cpu_profile(tmp_path, (0.0, 0.002, 0, 0)), "ttft:10,tpot:50", 2)
    assert not result["meets_slo"] and "no placement meets the SLO" in text
    fig = plan_figure(result)
    assert fig.axes == []  # no bars of zero goodput
    [shown] = [t.get_text() for t in fig.texts]
    assert shown.startswith("no placement meets the SLO at 4 req/s") and "up to 2 CPU instances" in shown
    assert all(f"{c['num_prefill']}P{c['num_decode']}D" in shown or f"{c['num_colocated']}C" in shown
               for c in result["nearest"])
