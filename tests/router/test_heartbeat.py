"""The heartbeat deadline of the cores this server started: one silent past
it is reported and killed (a real process, here one that sleeps, as a hung
core does nothing); one within it is greeted; a round that runs late judges
no one. The whole path through a real server (SIGSTOP of a core) is in
tests/serve/test_hung_core.py."""
from __future__ import annotations

import multiprocessing
import time

import pytest

from kvferry.engine.core_client import CoreAddresses, CoreProcess
from kvferry.messages import EngineCoreHello
from kvferry.router.config import RouterConfig
from kvferry.router.membership import HealthMonitor, Membership
from tests.router.fakes import READY, make_worker


@pytest.fixture
def sleeper():
    """A real child process that never answers (stands in for a stopped core)."""
    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,), daemon=True)
    process.start()
    yield CoreProcess(process, CoreAddresses("ipc:///nowhere-input", "ipc:///nowhere-output"))
    if process.is_alive():
        process.kill()
    process.join(10)


def monitor_of(*workers, heartbeat_timeout_s: float = 10.0):
    members = Membership("colocated", READY)
    for worker in workers:
        members.add(worker)
    reported: list[tuple[str, str]] = []
    monitor = HealthMonitor(members, 1.0, 30.0, lambda w, reason: reported.append((w.name, reason)),
                            heartbeat_timeout_s)
    return monitor, reported


def test_a_started_core_past_its_heartbeat_deadline_is_reported_and_killed(sleeper):
    hung = make_worker("engine-0", process=sleeper)
    fine = make_worker("engine-1")
    now = time.monotonic()
    hung.last_heard = now - 11
    monitor, reported = monitor_of(hung, fine)
    monitor.check(now)
    [(name, reason)] = reported
    assert name == "engine-0" and "missed its heartbeat" in reason and "engine-heartbeat-timeout 10" in reason
    sleeper.process.join(10)
    assert sleeper.exitcode == -9  # SIGKILL: a stopped process would ignore SIGTERM
    assert hung.connection.sent == [] and [type(m) for m in fine.connection.sent] == [EngineCoreHello]


def test_a_started_core_within_its_deadline_is_greeted_not_judged(sleeper):
    slow = make_worker("engine-0", process=sleeper)
    now = time.monotonic()
    slow.last_heard = now - 9  # a long step: past the joined cores' interval, within the deadline
    monitor, reported = monitor_of(slow)
    monitor.check(now)
    assert reported == [] and sleeper.is_alive()
    assert [type(m) for m in slow.connection.sent] == [EngineCoreHello]


def test_a_late_round_judges_no_one_and_zero_turns_the_deadline_off(sleeper):
    started = make_worker("engine-0", process=sleeper)
    joined = make_worker("engine-1", address="tcp://gone:1")
    monitor, reported = monitor_of(started, joined)
    now = time.monotonic()
    monitor.check(now)
    # This event loop was blocked for 40 s: the answers that came meanwhile
    # are still unread, so silence proves nothing this round...
    started.last_heard = joined.last_heard = now
    monitor.check(now + 40)
    assert reported == [] and sleeper.is_alive()
    # ...but the next one, on time, does judge.
    monitor.check(now + 41)
    assert [name for name, _ in reported] == ["engine-0", "engine-1"]

    off = make_worker("engine-0", process=sleeper)
    monitor, reported = monitor_of(off, heartbeat_timeout_s=0.0)
    off.last_heard = time.monotonic() - 3600
    monitor.check(time.monotonic())
    assert reported == []


def test_the_heartbeat_timeout_must_exceed_the_hello_interval():
    assert RouterConfig().engine_heartbeat_timeout_s == 10.0
    RouterConfig(engine_heartbeat_timeout_s=0)  # off
    with pytest.raises(ValueError, match="engine_heartbeat_timeout_s must exceed health_check_interval_s"):
        RouterConfig(engine_heartbeat_timeout_s=0.5, health_check_interval_s=1.0)
