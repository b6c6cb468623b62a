"""ckpt/store/traffic.py on real loopback connections: the bytes in flight
to a watched endpoint count, those to any other do not, an announced
request is discounted, and scanning leaves every socket's flags as they
were (a blocking socket stays blocking, even after
``socket.setdefaulttimeout``)."""

from __future__ import annotations

import fcntl
import os
import socket

import pytest

from ckpt.store import traffic


def _pair(server: socket.socket) -> tuple[socket.socket, socket.socket]:
  client = socket.create_connection(server.getsockname(), timeout=5)
  accepted, _ = server.accept()
  return client, accepted


def _moved() -> int:
  traffic._TRAFFIC._scanned = -1.0  # pylint: disable=protected-access
  return traffic.moved()  # (a fresh scan, not the cached one)


def _moved_after(fn) -> int:
  """moved() after ``fn()``, minus before it."""
  before = _moved()
  fn()
  return _moved() - before


@pytest.fixture
def servers():
  out = []
  for _ in range(2):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    out.append(s)
  yield out
  for s in out:
    s.close()


def _send(src: socket.socket, dst: socket.socket, n: int) -> None:
  src.sendall(b"x" * n)
  got = 0
  while got < n:
    got += len(dst.recv(n - got))


def test_bytes_to_a_watched_store_count_and_others_do_not(servers):
  store, other = servers
  traffic.watch({"driver": "s3", "bucket": "b",
                 "endpoint": f"http://127.0.0.1:{store.getsockname()[1]}"})
  to_store, at_store = _pair(store)
  to_other, at_other = _pair(other)
  try:
    # sent and answered: both directions count
    assert _moved_after(lambda: (_send(to_store, at_store, 100_000),
                                 _send(at_store, to_store, 5_000))
                        ) >= 105_000
    assert _moved_after(lambda: _send(to_other, at_other, 100_000)) == 0
    # a request announced aside (a lease renewal) is not progress
    assert _moved_after(lambda: (traffic.aside(1000),
                                 _send(to_store, at_store, 1000))) <= 0
  finally:
    for s in (to_store, at_store, to_other, at_other):
      s.close()


def test_a_scan_leaves_every_socket_blocking(servers):
  store, _ = servers
  traffic.watch({"driver": "s3", "bucket": "b",
                 "endpoint": f"http://127.0.0.1:{store.getsockname()[1]}"})
  old = socket.getdefaulttimeout()
  socket.setdefaulttimeout(5.0)
  try:
    client, accepted = _pair(store)
    client.setblocking(True)
    accepted.setblocking(True)
    _moved_after(lambda: _send(client, accepted, 10))
    for s in (client, accepted):
      assert not fcntl.fcntl(s.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK
    client.close()
    accepted.close()
  finally:
    socket.setdefaulttimeout(old)
