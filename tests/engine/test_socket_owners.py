"""Each ZeroMQ socket of an engine core is closed by the thread that uses it.

A socket closed while another thread is inside a call on it is undefined in
libzmq: the usual outcome is ``Assertion failed: pfd.revents & POLLIN
(src/signaler.cpp:238)`` and SIGABRT (the socket's mailbox fd is closed
under the blocked thread's poll). It once killed a decode core at shutdown:
a router refused it at join and disconnected, an output sent afterwards
blocked the core's output socket (no reader), and ``close`` closed that socket under
the blocked send after its join timed out.

Each case runs in a child process, since the failure aborts the process.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout_s)


def _assert_clean(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"rc {done.returncode}\n{done.stderr[-3000:]}"
    assert "Assertion failed" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_core_closes_promptly_when_its_front_end_left():
    """An output queued after the front end disconnected: the output thread
    gives up at the flush deadline and closes its own socket."""
    done = _run("""
        import time
        from kvferry.engine.core_client import CoreConnection, ipc_addresses
        from kvferry.engine.core_proc import EngineCoreProc

        addresses, _ = ipc_addresses()
        proc = EngineCoreProc(None, addresses)
        conn = CoreConnection(addresses)   # a router joins ...
        conn.hello()                       # (outputs go to the greeted front end only)
        proc.send_error("first")
        assert conn.output.poll(10_000)
        conn.output.recv()
        conn.close()                       # ... refuses this core and leaves
        time.sleep(0.3)
        proc.send_error("nobody reads this")  # the front end is gone: the send waits
        time.sleep(0.5)
        start = time.monotonic()
        proc.close()
        print("close took", time.monotonic() - start)
        """)
    _assert_clean(done)
    took = float(done.stdout.split("close took")[-1])
    assert took < 3.0, took  # the flush deadline (1 s), not a join timeout


def test_kv_receiver_close_never_closes_the_socket_under_its_thread():
    """The receiver thread is inside ``poll`` past ``close``'s join: it
    closes the socket itself when it comes out, without an error."""
    done = _run("""
        import time, torch
        from kvferry.disagg import transport

        transport._POLL_MS = 2300  # one poll outlasts the old 2 s join
        receiver = transport.KVReceiver(torch.zeros(1, 2, 4, 2, 1, 2), "tcp://127.0.0.1:0")
        time.sleep(0.2)
        receiver.close()
        assert receiver._sock.closed
        time.sleep(0.3)
        """)
    _assert_clean(done)
