"""RestartSupervisor: the restart budget and its backoff, giving up past
it, ending a restart, and holding requests while a role restarts. The
restart of a real process is covered by tests/serve/test_core_process.py."""
from __future__ import annotations

import asyncio
import time

import pytest

from kvferry.router.config import RouterConfig
from kvferry.router.errors import EngineDeadError
from kvferry.router.membership import Membership
from kvferry.router.supervisor import RESTART_BACKOFF_MAX_S, RestartSupervisor
from tests.router.fakes import READY, make_worker


class Host:
    """What the client would do on the supervisor's hooks, recorded."""

    def __init__(self) -> None:
        self.given_up: list[str] = []
        self.stopped = False

    async def stop_reading(self, worker) -> None:
        pass

    def adopt(self, old, new) -> None:
        raise AssertionError("no core is started in these tests")

    def supervisor(self, members: Membership, **config) -> RestartSupervisor:
        return RestartSupervisor(RouterConfig(**config), members, stop_reading=self.stop_reading, adopt=self.adopt,
                                 give_up=self.given_up.append, stopping=lambda: self.stopped)


def members_of(*workers) -> Membership:
    members = Membership("colocated", READY)
    for worker in workers:
        members.add(worker)
    return members


def test_backoff_doubles_to_its_cap_within_the_budget():
    supervisor = Host().supervisor(members_of(), engine_restarts=10)
    assert [supervisor.next_delay() for _ in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert RESTART_BACKOFF_MAX_S == 30.0
    supervisor.next_delay(), supervisor.next_delay()
    assert supervisor.next_delay() is None


def test_restarts_older_than_the_window_are_forgotten():
    supervisor = Host().supervisor(members_of(), engine_restarts=1, engine_restart_window_s=0.05)
    assert supervisor.next_delay() == 0.5
    assert supervisor.next_delay() is None
    time.sleep(0.06)
    assert supervisor.next_delay() == 0.5


def test_a_joined_core_is_never_restarted():
    supervisor = Host().supervisor(members_of())
    joined = make_worker("engine-0")  # no process: this server cannot start it
    assert not supervisor.can_restart(joined)


def test_a_death_past_the_budget_gives_up():
    async def main():
        host = Host()
        worker = make_worker("engine-0", alive=False)
        supervisor = host.supervisor(members_of(worker), engine_restarts=1, engine_restart_window_s=600)
        assert supervisor.restart(worker, "engine-0 exited with code -9")
        assert worker.restarting and host.given_up == []
        assert not supervisor.restart(worker, "engine-0 exited with code -9 again")
        assert host.given_up == ["engine-0 exited with code -9 again; no engine restart left (1 within 600 s), "
                                 "the server stops"]
        await supervisor.cancel(worker)  # leaving ends the restart
        assert not worker.restarting

    asyncio.run(main())


def test_a_request_waits_while_its_role_restarts_then_gets_the_fleets_error():
    async def main():
        host = Host()
        worker = make_worker("engine-0", alive=False)
        members = members_of(worker)
        supervisor = host.supervisor(members, engine_restart_wait_s=30)
        supervisor.restart(worker, "exited")
        waiter = asyncio.ensure_future(supervisor.wait_for_restarts(("engine",)))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        members.dead_error = EngineDeadError("given up")
        await supervisor.cancel_all()  # a restart that ends, however it ends, wakes the waiters
        with pytest.raises(EngineDeadError, match="given up"):
            await asyncio.wait_for(waiter, 5)

    asyncio.run(main())


def test_a_request_waits_no_longer_than_the_wait_and_not_at_all_with_a_live_peer():
    async def main():
        host = Host()
        dead, live = make_worker("engine-0", alive=False, restarting=True), make_worker("engine-1")
        supervisor = host.supervisor(members_of(dead, live), engine_restart_wait_s=10)
        await asyncio.wait_for(supervisor.wait_for_restarts(("engine",)), 1)  # engine-1 serves
        live.alive = False
        supervisor = host.supervisor(members_of(dead, live), engine_restart_wait_s=0.1)
        begin = time.monotonic()
        await supervisor.wait_for_restarts(("engine",))  # routing then answers engine_restarting
        assert 0.09 <= time.monotonic() - begin < 2

    asyncio.run(main())


def test_a_stopping_server_releases_the_waiters():
    async def main():
        host = Host()
        worker = make_worker("engine-0", alive=False)
        supervisor = host.supervisor(members_of(worker), engine_restart_wait_s=30)
        supervisor.restart(worker, "exited")
        waiter = asyncio.ensure_future(supervisor.wait_for_restarts(("engine",)))
        await asyncio.sleep(0.05)
        host.stopped = True
        await supervisor.cancel_all()
        with pytest.raises(EngineDeadError, match="the server is stopping"):
            await asyncio.wait_for(waiter, 5)

    asyncio.run(main())
