"""ZeroMQ sockets between the ranks of one group that may be on different
nodes (a TP or PP group spread by Ray): CURVE on every tcp:// socket, so
that only a peer holding this process tree's socket secret connects, and
what travels (steps, activations, partial sums) is encrypted.

    keys = RankKeys.of_tree()              # one key pair per tree, from peer_auth's socket secret
    guard = keys.guard(ctx)                # the context's ZAP handler: admits only our public key
    keys.server(sock); sock.bind(...)      # a bound socket (the leader's steps, a stage's activations)
    keys.client(sock); sock.connect(...)   # a connecting one

Every rank derives the same pair from the secret the front end handed its
process tree (KVFERRY_SOCKET_SECRET, peer_auth.py): the bound side proves
it holds the secret key of the public key the client expects, and the ZAP
handler refuses any client whose key is not that public key. A process that
merely reaches the port (any local user, any host on the network) completes
no handshake, so none of its frames is ever unpickled. Loopback tcp without
this is the weakness peer_auth.py names; ipc:// sockets in a 0700 folder
need none.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq
import zmq.auth.thread
from zmq.utils import z85

from kvferry import peer_auth

logger = logging.getLogger(__name__)

# peer_auth purpose: the key pair opens no other kind of socket.
RANK_GROUP = "rank-group"


@dataclass(frozen=True, slots=True)
class RankKeys:
    public: bytes  # z85, 40 bytes
    secret: bytes

    @staticmethod
    def of_tree() -> RankKeys:
        secret = z85.encode(peer_auth.token(RANK_GROUP))  # 32 bytes: a Curve25519 secret key
        return RankKeys(zmq.curve_public(secret), secret)

    def guard(self, ctx: zmq.Context) -> zmq.auth.thread.ThreadAuthenticator:
        """Start ``ctx``'s ZAP handler (stop it before ``ctx.term()``)."""
        auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logging.getLogger("kvferry.rank_sockets.zap"))
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=_OnlyKey(self.public))
        return auth

    def server(self, sock: zmq.Socket) -> zmq.Socket:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        return sock

    def client(self, sock: zmq.Socket) -> zmq.Socket:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.public
        return sock


class _OnlyKey:
    """ZAP callback: the tree's own public key, nothing else."""

    def __init__(self, public: bytes) -> None:
        self._public = public  # z85: the form pyzmq's authenticator passes the client's key in

    def callback(self, domain: str, key: bytes) -> bool:
        ok = peer_auth.check(bytes(key), self._public)
        if not ok:
            logger.warning("refused a rank connection with a foreign key (it does not hold the socket secret)")
        return ok
