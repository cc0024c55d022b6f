"""Membership: who serves, what /health says about them, who may join or
leave, and the health monitor's verdict on a silent joined worker."""
from __future__ import annotations

import asyncio
import time

import pytest

from kvferry.messages import EngineCoreHello
from kvferry.router.errors import EngineDeadError, EngineRestartingError
from kvferry.router.membership import HealthMonitor, Membership
from tests.router.fakes import READY, make_worker, other_ready


def members_of(mode: str, *workers) -> Membership:
    members = Membership(mode, READY)
    for worker in workers:
        members.add(worker)
    return members


def test_find_by_name_or_address_and_live_by_role():
    a = make_worker("prefill-0", "prefill", address="tcp://a:1")
    b = make_worker("decode-0", "decode", address="tcp://b:1")
    c = make_worker("decode-1", "decode", accepting=False)
    members = members_of("disagg", a, b, c)
    assert members.find("prefill-0") is a and members.find("tcp://b:1") is b
    with pytest.raises(KeyError):
        members.find("decode-9")
    assert members.live("decode") == [b]  # c is leaving
    b.alive = False
    assert members.live("decode") == [] and members.live("prefill") == [a]
    members.remove(a)
    assert list(members.workers) == ["decode-0", "decode-1"]


def test_role_of_and_next_name():
    assert Membership("colocated", READY).role_of("engine-3") == "engine"
    members = members_of("disagg", make_worker("prefill-0", "prefill"), make_worker("prefill-2", "prefill"))
    assert members.role_of("prefill-1") == "prefill" and members.role_of("decode-0") == "decode"
    # Two prefill workers: "prefill-2" is next, but taken.
    assert members.next_name("prefill") == "prefill-3"
    assert members.next_name("decode") == "decode-0"


def test_unavailable_names_a_restart_or_the_dead_role():
    dead = make_worker("engine-0", alive=False, dead_reason="it exited with code -9")
    members = members_of("colocated", dead)
    error = members.unavailable("engine")
    assert type(error) is EngineDeadError and str(error) == "no engine core is accepting requests"
    dead.restarting = True
    error = members.unavailable("engine")
    assert isinstance(error, EngineRestartingError)
    assert str(error) == "no engine core is up: engine-0 restarting (after: it exited with code -9)"
    assert members.only_restarting("engine") and members.any_up()
    dead.restarting = False
    assert not members.only_restarting("engine") and not members.any_up()


def test_only_restarting_is_false_while_a_peer_serves():
    a, b = make_worker("engine-0", alive=False, restarting=True), make_worker("engine-1")
    members = members_of("colocated", a, b)
    assert not members.only_restarting("engine")
    assert members.restarting() == [a] and members.restarting("engine") == [a]


def test_the_last_live_worker_of_a_role_cannot_leave():
    a, b = make_worker("engine-0"), make_worker("engine-1")
    members = members_of("colocated", a, b)
    members.check_can_leave(a)  # b still serves
    b.alive = False
    with pytest.raises(ValueError, match="last live engine worker"):
        members.check_can_leave(a)
    members.check_can_leave(b)  # a dead one may always go


def test_a_core_must_match_the_first_one():
    colocated, disagg = Membership("colocated", READY), Membership("disagg", READY)
    colocated.check_compatible(other_ready(pid=99), "tcp://x:1")  # another process of the same model
    with pytest.raises(ValueError, match="differs in block_size"):
        colocated.check_compatible(other_ready(block_size=8), "tcp://x:1")
    with pytest.raises(ValueError, match="differs in model_fingerprint"):
        disagg.check_compatible(other_ready(model_fingerprint="other"), "tcp://x:1")
    # Speculation matters only where a prefill core feeds a decode core's drafter:
    # a head's hidden state or a draft model's KV; token-only methods ship nothing.
    colocated.check_compatible(other_ready(speculative="head"), "tcp://x:1")
    disagg.check_compatible(other_ready(speculative="ngram"), "tcp://x:1")
    disagg.check_compatible(other_ready(speculative="auto"), "tcp://x:1")
    for shipped in ("head", "auto+head", "draft:fp"):
        with pytest.raises(ValueError, match="differs in speculative"):
            disagg.check_compatible(other_ready(speculative=shipped), "tcp://x:1")


def test_join_refuses_a_wrong_role_or_a_known_address_before_connecting():
    members = members_of("colocated", make_worker("engine-0", address="tcp://a:1"))
    with pytest.raises(ValueError, match="does not fit mode"):
        asyncio.run(members.join("tcp://b:1", "prefill", 1.0))
    with pytest.raises(ValueError, match="already a worker"):
        asyncio.run(members.join("tcp://a:1", "engine", 1.0))
    assert list(members.workers) == ["engine-0"]


def test_health_one_worker_ok_several_degraded():
    a = make_worker("engine-0")
    members = members_of("colocated", a)
    assert members.health(serving=True) == {"status": "ok"}
    b = make_worker("engine-1", alive=False, restarting=True, dead_reason="engine core engine-1 missed its heartbeat")
    members.add(b)
    assert members.health(serving=True) == {"status": "degraded", "workers": {"engine-0": True, "engine-1": False},
                                            "restarting": ["engine-1"],
                                            "errors": {"engine-1": "engine core engine-1 missed its heartbeat"}}


def test_health_of_a_role_without_a_live_core():
    p = make_worker("prefill-0", "prefill")
    d = make_worker("decode-0", "decode", alive=False, dead_reason="gone")
    members = members_of("disagg", p, d)
    # Prefill alone gets no request through: unavailable, never degraded.
    assert members.health(serving=True) == {"status": "unavailable", "reason": "no decode core is running: gone"}
    d.restarting = True
    assert members.health(serving=True) == {
        "status": "restarting", "reason": "no decode core is up: decode-0 restarting (after: gone)"}


def test_health_of_a_stopped_client_gives_the_fleets_error():
    members = members_of("colocated", make_worker("engine-0"))
    assert members.health(serving=False) == {"status": "unavailable", "reason": "the engine core is not running"}
    members.dead_error = EngineDeadError("no engine restart left")
    assert members.health(serving=False) == {"status": "unavailable", "reason": "no engine restart left"}


def test_health_monitor_greets_the_heard_and_reports_the_silent():
    heard = make_worker("engine-0")
    silent = make_worker("engine-1", address="tcp://gone:1")
    dead = make_worker("engine-2", alive=False)
    now = time.monotonic()
    silent.last_heard = dead.last_heard = now - 31
    reported: list[tuple[str, str]] = []
    monitor = HealthMonitor(members_of("colocated", heard, silent, dead), 1.0, 30.0,
                            lambda worker, reason: reported.append((worker.name, reason)))
    monitor.check(now)
    assert reported == [("engine-1", "worker engine-1 (tcp://gone:1) did not answer for 31 s")]
    assert [type(m) for m in heard.connection.sent] == [EngineCoreHello]
    assert silent.connection.sent == [] and dead.connection.sent == []
