"""The engine core as a process: "kvferry: engine-0", found by address.

    front end                     core process
    ---------                     ------------
    PUSH   --CoreInput-->  PULL    input thread: recv + decode -> inputs queue
                                     step loop:   drain inputs, apply, step    (no I/O, no serialization)
    DEALER <-CoreOutput--  ROUTER  output thread: outputs queue -> encode + send to the greeted peer

The core binds both sockets (ipc:// or tcp://), so the same process can
later serve a front end or router on another node. The step loop only
schedules and computes; socket I/O and msgspec work happen on the two
threads, which release the GIL while they wait. The first message out is
EngineCoreReady, once loaded and greeted by a front end holding this
process tree's token (core_auth.py: every input carries it; a hello
without it is answered with the reason, other messages are dropped), or,
if loading failed, EngineCoreOutputs with ``engine_error``; a failing loop
also sends ``engine_error`` before it exits, so the front end can tell its
clients why.

Outputs go to one peer only: the output socket whose routing id the last
authenticated hello named (``EngineCoreHello.reply_to``). A process that
connects to the output port without the token receives nothing, and a
refusal goes only to the stranger that asked, so it cannot end the
serving front end's session either.

Each socket has one owner thread, which alone calls it, closes it included:
a ZeroMQ socket closed while another thread is inside a call on it aborts
the process (libzmq: ``Assertion failed: pfd.revents & POLLIN
(signaler.cpp)``, the mailbox fd closed under that thread's poll). So no
thread waits inside a socket call without looking up: with no front end
connected (it left, or a router refused this core at join) an output waits,
so the output thread retries every few milliseconds and, once ``close``
began, gives up at a flush deadline.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable

import msgspec
import setproctitle
import torch
import zmq

from kvferry import envs, private_dirs
from kvferry.config import EngineConfig
from kvferry.core.kv_connector.disagg import first_token_word
from kvferry.engine.core import EngineCore
from kvferry.engine.core_addresses import CoreAddresses, parse_cpus
from kvferry.engine.core_auth import REFUSED, InputGate
from kvferry.engine.cpu_threads import bind_step_thread
from kvferry.gc_heap import freeze_startup_heap
from kvferry.messages import (
    CoreInput, EngineCoreAbort, EngineCoreDropPublicBlocks, EngineCoreFirstToken, EngineCoreHello, EngineCoreOutput,
    EngineCoreOutputs, EngineCorePurgeTenant, EngineCoreReady, EngineCoreRequest, EngineCoreShutdown, decode, encode,
)

logger = logging.getLogger(__name__)

# How long the idle step loop waits for input before its idle duties.
_IDLE_WAIT_S = 1.0
# How often the I/O threads and the parent watchdog look up from waiting.
_POLL_MS = 200
# How long ``close`` lets queued outputs (a final error) wait for a front end.
_FLUSH_S = 1.0
# How often an output with no connected front end is tried again.
_RETRY_S = 0.005


class _Addressed(msgspec.Struct):
    """An output for one peer that is not the greeted front end (a refusal)."""

    routing_id: bytes
    message: EngineCoreOutputs


class EngineCoreProc:
    """Runs an EngineCore behind two sockets. ``run()`` blocks (the step
    loop) until an EngineCoreShutdown arrives or the loop fails."""

    def __init__(self, core: EngineCore | None, addresses: CoreAddresses,
                 check_integrity_when_idle: bool = False) -> None:
        self.core = core
        self.check_integrity_when_idle = check_integrity_when_idle
        self.inputs: queue.SimpleQueue[CoreInput] = queue.SimpleQueue()
        self.outputs: queue.SimpleQueue[EngineCoreReady | EngineCoreOutputs | _Addressed | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        # Set once the model is loaded; the input thread answers hellos with it.
        self._ready: EngineCoreReady | None = None
        # Inputs count only with this process tree's token (core_auth.py); the
        # ready message goes out only once a front end holding it said hello,
        # so that one without it never takes the handshake for a join.
        self._gate = InputGate()
        self._greeted = False
        self._peer: bytes | None = None  # the greeted front end's output routing id (under _ready_lock)
        self._ready_lock = threading.Lock()
        self._refusals = 0
        self._flush_deadline = float("inf")  # set by close(): when the output thread stops waiting
        self._ctx = zmq.Context()
        # Created and bound here (a bad address fails the constructor); from
        # then on each is used, and closed, by its one I/O thread only.
        self._in_sock = self._ctx.socket(zmq.PULL)
        self._in_sock.bind(addresses.input)
        self._out_sock = self._ctx.socket(zmq.ROUTER)
        self._out_sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow reader
        # An unroutable id raises (EHOSTUNREACH) rather than dropping silently.
        self._out_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._out_sock.setsockopt(zmq.SNDTIMEO, _POLL_MS)
        self._out_sock.bind(addresses.output)
        # The addresses really bound (a tcp:// port "*" resolved): what a
        # front end connects to. Read here, before the threads own the sockets.
        self.bound = CoreAddresses(self._in_sock.getsockopt_string(zmq.LAST_ENDPOINT),
                                   self._out_sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self._threads = [
            threading.Thread(target=self._input_thread, name="core-input", daemon=True),
            threading.Thread(target=self._output_thread, name="core-output", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- I/O threads ------------------------------------------------------------------
    def _input_thread(self) -> None:
        try:
            self._receive_inputs()
        finally:
            self._in_sock.close(linger=0)  # here: no other thread may be inside a call on it

    def _receive_inputs(self) -> None:
        poller = zmq.Poller()
        poller.register(self._in_sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            frames = self._in_sock.recv_multipart()
            data = self._gate.open(frames)
            if data is None:
                self._refuse(frames[-1])
                continue
            try:
                message = decode(data, CoreInput)
            except Exception:  # a malformed message must not kill the core
                logger.exception("dropped an undecodable input message (%d bytes)", len(data))
                continue
            if isinstance(message, EngineCoreHello):
                # Answered here, not by the step loop: this is the router's
                # heartbeat (router/membership.py), and a core that misses
                # its deadline is killed as hung, so it must not wait for a
                # long prefill step; it needs the GIL only for a moment (the
                # step's kernels release it). Before loading ends, run()
                # sends the ready message once loaded.
                with self._ready_lock:
                    self._greeted = True
                    if message.reply_to:
                        self._peer = message.reply_to
                    ready = self._ready
                if ready is not None:
                    if ready.ranks:  # each rank's liveness as of this beat
                        ready = msgspec.structs.replace(ready, ranks=self.core.ranks(),
                                                        ffn_workers=self.core.ffn_workers())
                    self.outputs.put(ready)
                continue
            self.inputs.put(message)
            if isinstance(message, EngineCoreShutdown):
                # The last input the loop acts on: stop now, not at the next
                # poll's timeout (up to _POLL_MS more of every core's exit).
                return

    def _refuse(self, data: bytes) -> None:
        """A message without this core's token: a join (hello) gets the
        reason as an engine error, in one line on both sides; anything else
        is dropped (logged for the first and every 1000th)."""
        try:
            message = decode(data, CoreInput)
        except Exception:
            message = None
        if isinstance(message, EngineCoreHello):
            logger.warning("refused a join: %s", REFUSED.removeprefix("the engine core refused the join: "))
            if message.reply_to:  # to the asker only: never to the greeted front end
                refusal = EngineCoreOutputs(outputs=[], timestamp=time.monotonic(), engine_error=REFUSED)
                self.outputs.put(_Addressed(message.reply_to, refusal))
        else:
            self._refusals += 1
            if self._refusals % 1000 == 1:
                logger.warning("dropped %d input message(s) without this core's token so far (a front end "
                               "without its cache secret)", self._refusals)

    def _output_thread(self) -> None:
        dropped = 0
        try:
            while True:
                item = self.outputs.get()
                if item is None:
                    break
                if isinstance(item, _Addressed):
                    self._send_to_stranger(item.routing_id, encode(item.message))
                elif dropped or not self._send(encode(item)):
                    dropped += 1  # past the flush deadline with no front end: drop the rest
        finally:
            if dropped:
                logger.warning("no front end connected: %d output message(s) dropped at shutdown", dropped)
            # Here, not in close(): this thread may still be inside send.
            # The linger lets what is queued for a connected front end out.
            self._out_sock.close(linger=int(_FLUSH_S * 1000))

    def _send(self, data: bytes) -> bool:
        """Send one message to the greeted front end; False if none took it
        by the flush deadline. While the core runs, waits for a front end to
        greet and connect (a standalone core's ready message waits for its
        router); a later authenticated hello with another id takes over."""
        while True:
            with self._ready_lock:
                peer = self._peer
            if peer is not None:
                try:
                    self._out_sock.send_multipart([peer, data], copy=False)
                    return True
                except zmq.ZMQError as exc:  # not connected (yet, or any more)
                    if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                        raise
            if self._stop.is_set() and time.monotonic() >= self._flush_deadline:
                return False
            time.sleep(_RETRY_S)

    def _send_to_stranger(self, routing_id: bytes, data: bytes) -> None:
        """A refusal: once, and only if the asker's output socket is
        connected now. Waiting on a stranger would hold up the front end's
        outputs; a real joiner asks again (CoreConnection.wait_ready)."""
        try:
            self._out_sock.send_multipart([routing_id, data], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise

    # -- the step loop ------------------------------------------------------------------
    def run(self) -> None:
        assert self.core is not None
        ready = self.core.ready_message()
        with self._ready_lock:
            self._ready = ready
            greeted = self._greeted
        if greeted:  # else the first authenticated hello sends it
            self.outputs.put(ready)
        try:
            while self._turn():
                pass
        except BaseException as exc:
            logger.exception("engine core loop died")
            self.send_error(f"the engine core died: {exc!r}")
            raise
        finally:
            self.close()

    def send_error(self, reason: str) -> None:
        self.outputs.put(EngineCoreOutputs(outputs=[], timestamp=time.monotonic(), engine_error=reason))

    def _turn(self) -> bool:
        """Apply every pending input, then one step if there is work.
        Returns False on shutdown."""
        core = self.core
        core.check_ranks()  # a dead tensor-parallel rank ends the core, idle or not
        busy = core.has_unfinished_requests()
        inputs = self._drain(block=not busy)
        for message in inputs:
            if isinstance(message, EngineCoreShutdown):
                core.abort_requests(list(core.scheduler.requests))
                return False
            self._apply(message)
        if core.has_unfinished_requests():
            out = core.step()
        elif inputs or core.store_stats_changed():
            # Idle, but inputs changed the state (an abort freed blocks), or
            # the KV store's counters moved: say so.
            out = EngineCoreOutputs(outputs=[], timestamp=time.monotonic(), kv_events=core.take_kv_events())
        else:
            return True
        out.stats = core.stats()
        self.outputs.put(out)
        if self.check_integrity_when_idle and not core.has_unfinished_requests():
            core.check_integrity()  # once per busy -> idle transition
        return True

    def _drain(self, block: bool) -> list[CoreInput]:
        inputs: list[CoreInput] = []
        if block:
            try:
                inputs.append(self.inputs.get(timeout=_IDLE_WAIT_S))
            except queue.Empty:
                return inputs
        while True:
            try:
                inputs.append(self.inputs.get_nowait())
            except queue.Empty:
                return inputs

    def _apply(self, message: CoreInput) -> None:
        if isinstance(message, EngineCoreAbort):
            self.core.abort_requests(message.request_ids)
            return
        if isinstance(message, EngineCoreFirstToken):  # a disagg decode request's parked first token
            first_token_word(self.core.scheduler.connector, message.request_id, message.token_ids)
            return
        if isinstance(message, (EngineCorePurgeTenant, EngineCoreDropPublicBlocks)):
            if isinstance(message, EngineCorePurgeTenant):
                count = self.core.purge_tenant(message.tenant)
            else:
                count = self.core.drop_public_blocks(message.public_namespace, message.token_ids, message.first_block)
            purged = {message.purge_id: count}
            self.outputs.put(EngineCoreOutputs(outputs=[], timestamp=time.monotonic(), purged=purged,
                                               stats=self.core.stats()))
            return
        assert isinstance(message, EngineCoreRequest)
        try:
            self.core.add_request(message)
        except Exception as exc:  # noqa: BLE001 - one request's fault, whatever its kind
            # The front end validates first, so this is a front end bug (or a
            # peer that skipped it); end the request with an error rather
            # than the core: one request must never take the others down.
            logger.error("rejected request %s: %r", message.request_id, exc)
            self.outputs.put(EngineCoreOutputs(outputs=[_rejected(message.request_id)], timestamp=time.monotonic()))

    def request_shutdown(self) -> None:
        """Thread- and signal-safe: the loop stops at its next turn."""
        self.inputs.put(EngineCoreShutdown())

    def close(self) -> None:
        """Flush the output queue (for up to _FLUSH_S if no front end is
        connected), stop the I/O threads; each closes its own socket."""
        self._flush_deadline = time.monotonic() + _FLUSH_S
        self._stop.set()
        self.outputs.put(None)
        if self.core is not None:
            self.core.close()
        for t in self._threads:
            t.join(_FLUSH_S + 4 * _POLL_MS / 1000 + 2)
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            # Never close a socket under its thread, nor term the context
            # (it waits for every socket): the process exits around them.
            logger.warning("I/O thread(s) %s did not stop; leaving their sockets open", stuck)
        else:
            self._ctx.term()
        if self.core is not None:
            self.core.close()


def _rejected(request_id: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason="error")


# -- process entry point (multiprocessing spawn target) ---------------------------------
def run_engine_core(config: EngineConfig, addresses: CoreAddresses, name: str = "engine-0",
                    parent_pid: int | None = None, check_integrity_when_idle: bool = False,
                    log_level: str = "INFO", cpus: str | None = None) -> None:
    """Load the model, report ready, serve until shutdown. Exits non-zero on
    failure. With ``parent_pid`` set, also exits once that process is gone.
    ``cpus`` ("0", "2-3", "0,2"): the CPUs this process may run on."""
    setproctitle.setproctitle(f"kvferry: {name}")
    if cpus:
        allowed = parse_cpus(cpus)
        os.sched_setaffinity(0, allowed)
        # OpenMP sized its team when torch was imported (every CPU): more
        # threads than allowed CPUs would spin against each other.
        torch.set_num_threads(len(allowed))
    # Ctrl-C reaches the whole process group; the front end decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")
    if parent_pid is not None:
        _watch_parent(parent_pid, private_dirs.folder_of(addresses.input))
    proc = EngineCoreProc(None, addresses, check_integrity_when_idle)
    sys.exit(0 if _run_off_main_thread(proc, lambda: EngineCore(config)) else 1)


def _run_off_main_thread(proc: EngineCoreProc, build_core: Callable[[], EngineCore]) -> bool:
    """Build the core and run the step loop on one thread of its own; True
    if it ended cleanly. The main thread only waits, and so stays free for
    signals (SIGTERM drains once the core is built).

    One thread does every torch op of the process, the model's loading and
    weight packing included: each thread that runs a parallel op gets an
    OpenMP team of its own, and once the process holds more OpenMP threads
    than CPUs, libgomp stops spin-waiting between parallel regions (its
    throttled spin count) and puts the workers to sleep at each one. With
    the model loaded on the main thread and stepped on this one, a decode
    step at batch 64 took 93 ms served against 57 ms offline, and an
    offline run on a second thread 1.33x as long as on the first. The step
    thread sizes its OpenMP team and, with KVFERRY_CPU_BIND set, pins it
    one thread per core (cpu_threads).
    """
    failed: list[BaseException] = []
    built = threading.Event()
    draining = threading.Event()  # the SIGTERM handler is installed: the loop may report ready

    def loop() -> None:
        try:
            binding = bind_step_thread()  # before any op: this thread's OpenMP team is new
            if binding is not None:
                logger.info("OpenMP threads pinned (%s): %s", envs.CPU_BIND, binding.describe())
            try:
                proc.core = build_core()
            except Exception as exc:
                if isinstance(exc, ValueError):  # a configuration mistake: one line says it (no traceback)
                    logger.error("engine core failed to start: %s", exc)
                else:
                    logger.exception("engine core failed to start")
                proc.send_error(f"the engine core failed to start: {exc}")
                proc.close()
                failed.append(exc)
                return
            freeze_startup_heap("engine core")  # no full-heap GC pauses inside steps
            built.set()
            # Not ready before SIGTERM drains: whoever sees the ready message
            # may send SIGTERM at once.
            draining.wait()
            proc.run()
        except BaseException as exc:  # logged and reported to the front end by run()
            failed.append(exc)

    thread = threading.Thread(target=loop, name="core-steps")
    thread.start()
    while thread.is_alive() and not built.wait(0.05):
        pass
    if built.is_set():
        # Until the core is built, SIGTERM ends the process at once, as it
        # did before the split; from now on it drains.
        signal.signal(signal.SIGTERM, lambda signum, frame: proc.request_shutdown())
    draining.set()
    while thread.is_alive():
        thread.join(0.5)
    return not failed


def run_from_args(args, config: EngineConfig) -> int:  # args: the parsed ``kvferry engine-core`` flags
    """``kvferry engine-core``: a core on its own, for a front end (or a
    router) that connects by address, e.g. from another node over tcp://."""
    if args.address:
        addresses = CoreAddresses.from_address(args.address)
    elif args.input_address and args.output_address:
        addresses = CoreAddresses(args.input_address, args.output_address)
    else:
        raise SystemExit("kvferry engine-core: give --address, or both --input-address and --output-address")
    run_engine_core(config, addresses, args.name, None, args.check_kv_integrity, args.log_level, args.cpus)
    return 0



def _watch_parent(parent_pid: int, folder: str | None) -> None:
    """Exit as soon as the process that started us is gone: an engine core
    nobody can reach must not hold memory (or a GPU) forever. ``folder``:
    our sockets' private folder, which a parent killed outright left."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_POLL_MS / 1000)
        logger.warning("parent process %d is gone; engine core exiting", parent_pid)
        private_dirs.remove(folder)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
