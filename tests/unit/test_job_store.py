"""The launched job's rendezvous store over real sockets on loopback: torch's Store semantics
for the job's processes, nothing for a process without the job's secret."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from raytrain_x.comm.job_store import MAGIC, JobStoreClient, JobStoreServer
from raytrain_x.common.errors import RendezvousTimeout, StoreAuthError
from raytrain_x.testing.waiting import free_port
from tests.limits import limit

SECRET = "s" * 32


@pytest.fixture
def server():
    s = JobStoreServer("127.0.0.1", SECRET)
    try:
        yield s
    finally:
        s.close()


def _client(server: JobStoreServer, secret: str = SECRET, timeout_s: float = 2.0):
    return JobStoreClient(server.host, server.port, secret, timeout_s)


def test_store_semantics(server):
    c = _client(server)
    c.set("a", b"1")
    assert c.get("a") == b"1"
    assert c.add("n", 2) == 2 and c.add("n", 3) == 5
    assert c.compare_set("k", b"", b"x") == b"x"  # missing key, empty expectation: set
    assert c.compare_set("k", b"y", b"z") == b"x"  # mismatch: current value, unchanged
    assert c.compare_set("k", b"x", b"z") == b"z"
    assert c.check(["a", "n"]) and not c.check(["a", "missing"])
    assert c.num_keys() == 3
    assert c.delete_key("a") and not c.delete_key("a")
    c.set("", b"")
    assert c.get("") == b""


def test_get_and_wait_block_until_another_client_sets(server):
    waiter, setter = _client(server), _client(server)
    threading.Timer(0.2, lambda: setter.set("late", b"v")).start()
    assert waiter.get("late") == b"v"
    with pytest.raises(RendezvousTimeout, match="did not appear within"):
        JobStoreClient(server.host, server.port, SECRET, timeout_s=0.2).get("never")
    with pytest.raises(RendezvousTimeout, match="did not all appear"):
        waiter.wait(["late", "never"], timeout_s=0.2)


def test_threads_of_one_client_do_not_wait_on_each_other(server):
    c = _client(server, timeout_s=5.0)
    got = []
    t = threading.Thread(target=lambda: got.append(c.get("x")))
    t.start()
    time.sleep(0.1)
    c.set("x", b"ok")  # while the other thread's get blocks on its own connection
    t.join(5)
    assert got == [b"ok"]


def test_a_wrong_secret_is_refused_before_any_request(server):
    _client(server).set("job-key", b"v")
    intruder = _client(server, secret="x" * 32)
    with pytest.raises(StoreAuthError, match="refused this process's secret"):
        intruder.set("intruder", b"v")
    with pytest.raises(StoreAuthError):
        intruder.num_keys()
    assert server.refused == 2
    assert _client(server).check(["job-key"]) and not _client(server).check(["intruder"])


def test_a_raw_connection_gets_nothing_and_is_dropped(server):
    with socket.create_connection((server.host, server.port), timeout=5) as raw:
        greeting = raw.recv(len(MAGIC) + 32)
        assert greeting.startswith(MAGIC)  # a random nonce, no data
        raw.sendall(b"\x00" * 64)  # not a proof
        raw.settimeout(5)
        assert raw.recv(100) == b""  # closed on us
    assert server.refused == 1
    assert server.table.num_keys() == 0


def test_a_client_refuses_a_server_that_cannot_prove_the_secret():
    """An impostor listening on the store's port that lets anyone in: the client sends
    nothing but its proof, and stops there."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = []

    def impostor():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(MAGIC + b"n" * 32)
            received.append(conn.recv(64))
            conn.sendall(b"p" * 32)  # not the proof
            conn.settimeout(2)
            received.append(conn.recv(100))  # what the client sends next: nothing

    t = threading.Thread(target=impostor)
    t.start()
    try:
        client = JobStoreClient("127.0.0.1", listener.getsockname()[1], SECRET, 2.0)
        with pytest.raises(StoreAuthError, match="not this job's store"):
            client.set("key", b"value")
        t.join(5)
    finally:
        listener.close()
    assert received[1] == b"" and b"value" not in received[0]


def test_short_secrets_and_absent_servers_are_clear_errors():
    with pytest.raises(StoreAuthError, match="fewer than 16"):
        JobStoreServer("127.0.0.1", "short")
    port = free_port()
    with pytest.raises(RendezvousTimeout, match="could not reach the job's store"):
        JobStoreClient("127.0.0.1", port, SECRET, timeout_s=0.3).num_keys()


def test_env_rendezvous_needs_a_secret_unless_the_store_is_on_loopback():
    from raytrain_x.comm.rendezvous import loopback_secret, rendezvous_from_env
    from raytrain_x.common.errors import ConfigError

    env = {"RAYTRAIN_X_SIZE": "2", "RAYTRAIN_X_RANK": "1", "RAYTRAIN_X_STORE_PORT": "29500"}
    with pytest.raises(ConfigError, match="RAYTRAIN_X_STORE_SECRET"):
        rendezvous_from_env({**env, "RAYTRAIN_X_STORE_ADDR": "10.0.0.5"})
    for local in ("127.0.0.1", "localhost", "::1"):
        rdv = rendezvous_from_env({**env, "RAYTRAIN_X_STORE_ADDR": local})
        assert rdv.store.secret == loopback_secret() and rdv.rank == 1
    given = rendezvous_from_env({**env, "RAYTRAIN_X_STORE_ADDR": "10.0.0.5",
                                 "RAYTRAIN_X_STORE_SECRET": SECRET})
    assert given.store.secret == SECRET


def test_a_flood_of_unproven_connections_is_capped_and_the_job_still_gets_in():
    """Anyone who reaches rank 0's port could hold a thread per connection for 30 s, with
    no cap: the extra ones are now closed at once, and the job's clients still connect."""
    server = JobStoreServer("127.0.0.1", SECRET, max_unproven=8, handshake_timeout_s=30)
    flood = [socket.create_connection((server.host, server.port), timeout=5)
             for _ in range(40)]
    try:
        deadline = time.monotonic() + 10
        while server.refused < 32 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.unproven <= 8 and server.refused >= 32
        assert flood[-1].recv(100) == b""  # one beyond the cap: closed at once
        for raw in flood[:8]:  # those served only wait for their handshake
            raw.close()
        # their threads see them close (a loaded machine may take a moment); until then
        # they count against the cap, and a client would be turned away as the flood was
        deadline = time.monotonic() + 10
        while server.unproven and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.unproven == 0
        client = _client(server, timeout_s=5)
        client.set("k", b"v")
        assert client.get("k") == b"v"
    finally:
        for raw in flood:
            raw.close()
        server.close()


def test_an_unproven_connection_is_dropped_after_the_handshake_timeout_however_it_trickles():
    server = JobStoreServer("127.0.0.1", SECRET, handshake_timeout_s=1.0)
    try:
        with socket.create_connection((server.host, server.port), timeout=5) as raw:
            raw.recv(len(MAGIC) + 32)
            began = time.monotonic()
            closed = False
            while time.monotonic() - began < 5 and not closed:
                try:
                    raw.sendall(b"\x00")  # a byte at a time, never a whole proof
                    raw.settimeout(0.2)
                    closed = raw.recv(1) == b""
                except TimeoutError:
                    pass
                except OSError:
                    closed = True
            assert closed and time.monotonic() - began < limit(3)
    finally:
        server.close()


def test_a_failed_thread_start_drops_one_connection_and_the_store_keeps_accepting(monkeypatch):
    """A `RuntimeError` from starting a connection's thread ended the accept loop for good:
    every later rank got `RendezvousTimeout`."""
    server = JobStoreServer("127.0.0.1", SECRET)
    start = threading.Thread.start
    failed = []

    def once(self):
        if self.name != "raytrain-x-store" and not failed:
            failed.append(self)
            raise RuntimeError("can't start new thread")
        return start(self)

    try:
        monkeypatch.setattr(threading.Thread, "start", once)
        with socket.create_connection((server.host, server.port), timeout=5) as raw:
            raw.settimeout(5)
            assert raw.recv(100) == b""  # that one is dropped
        monkeypatch.setattr(threading.Thread, "start", start)
        client = _client(server, timeout_s=5)
        client.set("k", b"v")
        assert client.get("k") == b"v" and failed
    finally:
        server.close()


def _serve_forever(port_file: str) -> None:
    server = JobStoreServer("127.0.0.1", SECRET)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.port))
    import os

    os.replace(port_file + ".tmp", port_file)
    while True:
        time.sleep(1)


def test_a_request_to_a_rank_0_that_vanished_mid_request_ends_within_the_timeout(tmp_path):
    """After its handshake the client set no timeout: a rank 0 whose host vanished (no FIN:
    here the server process is stopped, SIGSTOP) held group creation forever."""
    import multiprocessing
    import os
    import signal

    port_file = str(tmp_path / "port")
    proc = multiprocessing.get_context("spawn").Process(target=_serve_forever,
                                                        args=(port_file,), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        port = int(open(port_file).read())
        client = JobStoreClient("127.0.0.1", port, SECRET, timeout_s=1.0)
        client.set("k", b"v")  # connected and proved
        os.kill(proc.pid, signal.SIGSTOP)
        while open(f"/proc/{proc.pid}/stat").read().split(") ")[1][0] != "T":
            time.sleep(0.01)  # stopped: it answers nothing from here on
        began = time.monotonic()
        with pytest.raises(ConnectionError, match="did not answer within 1s"):
            client.set("k", b"w")
        assert time.monotonic() - began < limit(5)
        with pytest.raises((ConnectionError, RendezvousTimeout)):
            client.get("k")  # its own wait plus the timeout, then the same
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)


def test_a_loopback_store_is_this_users_and_no_other_local_users(monkeypatch):
    """Without a secret a loopback store used a fixed public one: any local user could
    read and write a running job's keys. Each user now has a secret of its own in a file
    only it can read; another user's process holds another secret and is refused."""
    import os
    import stat
    import tempfile

    from raytrain_x.comm import rendezvous
    from raytrain_x.comm.rendezvous import loopback_secret

    secret = loopback_secret()
    assert secret == loopback_secret() and len(secret) == 64  # one per user, kept
    folder = os.path.join(tempfile.gettempdir(), f"raytrain-x-{os.getuid()}")
    for path, mode in ((folder, 0o700), (os.path.join(folder, "store-secret"), 0o600)):
        info = os.stat(path)
        assert stat.S_IMODE(info.st_mode) == mode and info.st_uid == os.getuid(), path
    server = JobStoreServer("127.0.0.1", secret)
    other = tempfile.mkdtemp()
    try:
        # another user's process: its own uid, so its own folder and secret
        monkeypatch.setattr(rendezvous.tempfile, "gettempdir", lambda: other)
        theirs = loopback_secret()
        assert theirs != secret
        with pytest.raises(StoreAuthError):
            JobStoreClient("127.0.0.1", server.port, theirs, 5).set("k", b"stolen")
        assert server.table.num_keys() == 0
    finally:
        server.close()
        import shutil

        shutil.rmtree(other, ignore_errors=True)
