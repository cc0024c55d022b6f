"""Who may drive an engine core: a front end (or router) that holds the
same socket secret, i.e. one started with the core (it inherits the
secret) or, for a core started apart with ``kvferry engine-core``, given
the same ``--cache-secret-file`` (peer_auth.py). Every input message is
two frames, ``[token, message]``; the core acts on none whose token is
not its own, so a server with no cache secret file, or another one,
cannot join it (nor can anyone who merely reaches its port).

    core_token()             what a front end sends before each message (CoreConnection)
    InputGate().open(frames) -> the message bytes, or None: refuse it
    REFUSED                  the reason both sides print, in one line

The core answers a refused hello (a join) with this reason as an
``engine_error``, so that the joining server fails in one line too.
"""
from __future__ import annotations

from kvferry import peer_auth

REFUSED = ("the engine core refused the join: this server does not hold the core's cache secret; give "
           "`kvferry serve` and `kvferry engine-core` the same --cache-secret-file")


def core_token() -> bytes:
    """This process tree's token for engine cores' input sockets."""
    return peer_auth.token(peer_auth.ENGINE_CORE)


class InputGate:
    """The core's side: the token, computed once (the check is then one
    constant-time comparison per message)."""

    def __init__(self) -> None:
        self._token = core_token()

    def open(self, frames: list[bytes]) -> bytes | None:
        if len(frames) == 2 and peer_auth.check(frames[0], self._token):
            return frames[1]
        return None
