"""The rendezvous store of a job whose workers are plain processes (`raytrain-x run`): a TCP
key-value store that rank 0 serves and that answers only clients proving the job's secret.

torch's `TCPStore` has no credential: anyone who reaches its port can list, read and write
the keys the job meets at. This store, bound to rank 0's node address rather than to every
interface, opens each connection with a mutual challenge (HMAC-SHA256 of fresh nonces under
the per-job secret): a client that does not prove the secret is disconnected before it can
send a request, and the client refuses a server that does not prove it back. The secret
never crosses the connection.

Stdlib only (no torch, no Ray); backends adapt `JobStoreClient` to their own store type, as
they do `ActorStore`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence

from raytrain_x.comm.key_table import KeyTable
from raytrain_x.common.errors import RendezvousTimeout, StoreAuthError
from raytrain_x.common.process import PROCESS
from raytrain_x.common.settings import TIMEOUT_S

MAGIC = b"RTXS1"
NONCE_BYTES = 32
# A connection that has not proved the secret is dropped after this long in all (however
# slowly it trickles bytes), and at most this many are served at once: a flood of them
# from anyone who reaches the port never starves the job's own ranks of threads, and
# those beyond it are closed at once
HANDSHAKE_TIMEOUT_S = 10.0
MAX_UNPROVEN = 64
SECRET_MIN_BYTES = 16
_LEN = struct.Struct("!I")
_MAX_FRAME = 1 << 30
_OK, _MISSING = b"\x01", b"\x00"


def _proof(secret: bytes, role: bytes, *nonces: bytes) -> bytes:
    return hmac.new(secret, role + b"".join(nonces), hashlib.sha256).digest()


def _check_secret(secret: bytes) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode()
    if len(secret) < SECRET_MIN_BYTES:
        raise StoreAuthError(f"the store's secret has {len(secret)} bytes, fewer than "
                             f"{SECRET_MIN_BYTES}; use a random one, e.g. secrets.token_hex(32)")
    return secret


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; with `deadline` (monotonic), a `TimeoutError` once it passes."""
    chunks, left = [], n
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the store handshake took too long")
            sock.settimeout(remaining)
        chunk = sock.recv(left)
        if not chunk:
            raise ConnectionError("the store connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _send_fields(sock: socket.socket, fields: Sequence[bytes]) -> None:
    body = b"".join(_LEN.pack(len(f)) + f for f in fields)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_fields(sock: socket.socket) -> list[bytes]:
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if size > _MAX_FRAME:
        raise ConnectionError(f"a store frame of {size} bytes is over the limit")
    body = _recv_exact(sock, size)
    fields, at = [], 0
    while at < size:
        (n,) = _LEN.unpack_from(body, at)
        fields.append(body[at + _LEN.size:at + _LEN.size + n])
        at += _LEN.size + n
    return fields


class JobStoreServer:
    """Serves a `KeyTable` on `host:port` to clients that prove `secret`.

    Args:
        host: the address to listen on (the node's own address, not every interface).
        secret: the job's secret (at least 16 bytes), shared with every worker.
        port: the port; 0 picks a free one (`self.port` says which).
    """

    def __init__(self, host: str, secret: bytes | str, port: int = 0,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_unproven: int = MAX_UNPROVEN) -> None:
        self._secret = _check_secret(secret)
        self.table = KeyTable()
        self.refused = 0  # connections dropped for a missing or wrong proof, or too many
        self.unproven = 0  # connections that have not proved the secret yet
        self._handshake_timeout_s = handshake_timeout_s
        self._max_unproven = max_unproven
        self._count_lock = threading.Lock()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._closed = False
        self._accepter = threading.Thread(target=self._accept, daemon=True,
                                          name="raytrain-x-store")
        self._accepter.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept(self) -> None:
        """Accepts until closed. Nothing a connection does stops it: too many unproven
        ones are closed at once, and a failure to accept (no file descriptors left) or to
        start a thread (none left) drops that one connection and goes on."""
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # EMFILE and the like: later accepts may succeed
                continue
            with self._count_lock:
                full = self.unproven >= self._max_unproven
                if not full:
                    self.unproven += 1
            if full:
                self.refused += 1
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()
            except RuntimeError:  # can't start new thread
                self._proven_or_dropped()
                self.refused += 1
                conn.close()
                time.sleep(0.05)

    def _proven_or_dropped(self) -> None:
        with self._count_lock:
            self.unproven -= 1

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                proved = self._handshake(conn)
            except (ConnectionError, OSError):
                proved = False
            finally:
                self._proven_or_dropped()
            if not proved:
                self.refused += 1
                return
            conn.settimeout(None)
            try:
                while True:
                    _send_fields(conn, self._answer(_recv_fields(conn)))
            except (ConnectionError, OSError, struct.error, ValueError):
                return

    def _handshake(self, conn: socket.socket) -> bool:
        deadline = time.monotonic() + self._handshake_timeout_s
        conn.settimeout(self._handshake_timeout_s)
        server_nonce = os.urandom(NONCE_BYTES)
        conn.sendall(MAGIC + server_nonce)
        client_nonce = _recv_exact(conn, NONCE_BYTES, deadline)
        proof = _recv_exact(conn, hashlib.sha256().digest_size, deadline)
        if not hmac.compare_digest(proof, _proof(self._secret, b"client", server_nonce,
                                                 client_nonce)):
            return False
        conn.sendall(_proof(self._secret, b"server", client_nonce, server_nonce))
        return True

    def _answer(self, request: list[bytes]) -> list[bytes]:
        op, args = request[0].decode(), request[1:]
        table = self.table
        if op == "set":
            table.set(args[0].decode(), args[1])
            return [_OK]
        if op == "get":
            value = table.get(args[0].decode(), float(args[1]))
            return [_MISSING] if value is None else [_OK, value]
        if op == "add":
            return [str(table.add(args[0].decode(), int(args[1]))).encode()]
        if op == "compare_set":
            return [table.compare_set(args[0].decode(), args[1], args[2])]
        if op == "wait":
            return [_OK if table.wait([k.decode() for k in args[1:]], float(args[0]))
                    else _MISSING]
        if op == "check":
            return [_OK if table.check([k.decode() for k in args]) else _MISSING]
        if op == "delete_key":
            return [_OK if table.delete_key(args[0].decode()) else _MISSING]
        if op == "num_keys":
            return [str(table.num_keys()).encode()]
        raise ValueError(f"unknown store request {op!r}")


class JobStoreClient:
    """A client of a `JobStoreServer`, with the methods of `ActorStore`.

    Each thread has its own connection, so one thread's blocking `get` never holds up
    another's `set`.

    Args:
        host, port: where the server listens.
        secret: the job's secret.
        timeout_s: how long `get`/`wait` block, and how long connecting is retried while
            rank 0's server is not up yet, before raising `RendezvousTimeout`.
    """

    def __init__(self, host: str, port: int, secret: bytes | str,
                 timeout_s: float = TIMEOUT_S.default) -> None:
        self.host, self.port = host, int(port)
        self._secret = _check_secret(secret)
        self.timeout_s = timeout_s
        self._local = threading.local()

    def __reduce__(self):
        return (JobStoreClient, (self.host, self.port, self._secret, self.timeout_s))

    def _connect(self) -> socket.socket:
        """A connection that passed the mutual proof. Waits for rank 0 to listen, and for a
        busy rank 0 to answer, until the rendezvous timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = max(deadline - time.monotonic(), 0.5)
            try:
                sock = socket.create_connection((self.host, self.port), timeout=min(left, 5.0))
            except OSError as exc:  # rank 0 may not listen yet
                if time.monotonic() > deadline:
                    raise RendezvousTimeout(
                        f"could not reach the job's store at {self.host}:{self.port} within "
                        f"{self.timeout_s:.0f}s ({exc}); rank 0 did not start or died"
                    ) from None
                time.sleep(0.1)
                continue
            try:
                sock.settimeout(left)  # a loaded rank 0 may take a while to answer
                self._prove(sock)
            except TimeoutError:
                sock.close()
                if time.monotonic() > deadline:
                    raise RendezvousTimeout(
                        f"the job's store at {self.host}:{self.port} accepted but did not "
                        f"answer within {self.timeout_s:.0f}s; rank 0 is stalled") from None
                continue
            except BaseException:
                sock.close()
                raise
            sock.settimeout(None)
            return sock

    def _prove(self, sock: socket.socket) -> None:
        magic = _recv_exact(sock, len(MAGIC))
        if magic != MAGIC:
            raise StoreAuthError(f"{self.host}:{self.port} is not a raytrain-x job store")
        server_nonce = _recv_exact(sock, NONCE_BYTES)
        client_nonce = os.urandom(NONCE_BYTES)
        sock.sendall(client_nonce + _proof(self._secret, b"client", server_nonce,
                                           client_nonce))
        try:
            answer = _recv_exact(sock, hashlib.sha256().digest_size)
        except ConnectionError:
            raise StoreAuthError(
                f"the job's store at {self.host}:{self.port} refused this process's "
                "secret; every process of a job needs the same RAYTRAIN_X_STORE_SECRET"
            ) from None
        if not hmac.compare_digest(answer, _proof(self._secret, b"server", client_nonce,
                                                  server_nonce)):
            raise StoreAuthError(f"the store at {self.host}:{self.port} does not know "
                                 "this job's secret; it is not this job's store")

    def _request(self, *fields: bytes, wait_s: float = 0.0) -> list[bytes]:
        """One request and its answer, within the store's timeout beyond the `wait_s` the
        server itself may wait (`get`, `wait`): a rank 0 whose host vanished mid-request
        (no FIN, no RST) is a `ConnectionError` then, not a wait that never ends."""
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._local.sock = self._connect()
        try:
            sock.settimeout(self.timeout_s + wait_s)
            _send_fields(sock, fields)
            return _recv_fields(sock)
        except TimeoutError as exc:
            self._local.sock = None
            sock.close()
            raise ConnectionError(
                f"the job's store at {self.host}:{self.port} did not answer within "
                f"{self.timeout_s + wait_s:.0f}s; rank 0 stalled or its host is unreachable"
            ) from exc
        except OSError as exc:
            self._local.sock = None
            sock.close()
            raise ConnectionError(f"lost the job's store at {self.host}:{self.port} ({exc}); "
                                  "rank 0 exited or its host is unreachable") from exc

    def close(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            sock.close()
            self._local.sock = None

    def set(self, key: str, value: bytes | str) -> None:
        self._request(b"set", key.encode(), _as_bytes(value))

    def get(self, key: str) -> bytes:
        reply = self._request(b"get", key.encode(), repr(self.timeout_s).encode(),
                              wait_s=self.timeout_s)
        if reply[0] == _MISSING:
            raise RendezvousTimeout(f"rendezvous key {key!r} did not appear within "
                                    f"{self.timeout_s:.0f}s; a worker did not start or died")
        return reply[1]

    def add(self, key: str, amount: int) -> int:
        return int(self._request(b"add", key.encode(), str(int(amount)).encode())[0])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._request(b"compare_set", key.encode(), _as_bytes(expected),
                             _as_bytes(desired))[0]

    def wait(self, keys: Sequence[str], timeout_s: float | None = None) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        reply = self._request(b"wait", repr(timeout_s).encode(), *(k.encode() for k in keys),
                              wait_s=timeout_s)
        if reply[0] == _MISSING:
            raise RendezvousTimeout(f"rendezvous keys {list(keys)} did not all appear within "
                                    f"{timeout_s:.0f}s; a worker did not start or died")

    def check(self, keys: Sequence[str]) -> bool:
        return self._request(b"check", *(k.encode() for k in keys))[0] == _OK

    def delete_key(self, key: str) -> bool:
        return self._request(b"delete_key", key.encode())[0] == _OK

    def num_keys(self) -> int:
        return int(self._request(b"num_keys")[0])


def open_job_store(host: str, port: int, secret: bytes | str, timeout_s: float,
                   serve: bool) -> JobStoreClient:
    """The client of a job's store; with `serve`, this process serves it first (rank 0)."""
    # init() again after shutdown(): the same store
    if serve and not any(s.host == host and s.port == port and not s._closed
                         for s in PROCESS.store_servers):
        try:
            server = JobStoreServer(host, secret, port)
        except OSError as exc:  # the launcher picked the port free; another took it since
            raise RendezvousTimeout(
                f"rank 0 could not listen on {host}:{port} for the job's store ({exc}); "
                "another process took the port after it was picked: start the job again"
            ) from None
        PROCESS.store_servers.append(server)
    return JobStoreClient(host, port, secret, timeout_s)


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


