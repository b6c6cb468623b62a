"""A TCP proxy on 127.0.0.1 that can make a live store die, two ways.

Tests put it between ckpt and a real server (moto) and then stop the store
the way networks do:

- ``refuse()``: the proxy stops listening and resets every open connection;
  new connections are refused (a crashed server, a closed port).
- ``black_hole()``: the proxy keeps accepting connections but no byte
  crosses it any more in either direction (a hung server, a dropped route):
  a client waits for an answer that never comes.
- ``resume()``: forwards again on the same port (the store came back);
  connections left from the black hole are reset, so clients reconnect.

One accept thread and two pump threads per connection, every blocking call
with a short timeout, at most ``MAX_CONNECTIONS`` open at once (more are
closed at accept): ``close()`` ends them all within a second or two.
"""

from __future__ import annotations

import select
import socket
import struct
import threading

from ckpt import local_cluster

MAX_CONNECTIONS = 256
POLL_S = 0.1


def _reset(sock: socket.socket) -> None:
  """Closes ``sock`` with a TCP reset (SO_LINGER 0), not a graceful FIN."""
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                    struct.pack("ii", 1, 0))
  except OSError:
    pass
  try:
    sock.close()
  except OSError:
    pass


class Proxy:
  """Forwards ``127.0.0.1:<port>`` to ``target`` (host, port)."""

  def __init__(self, target: tuple[str, int]):
    self.target = target
    self.port = local_cluster.free_port()
    self.endpoint = f"http://127.0.0.1:{self.port}"
    self.mode = "forward"  # "forward" | "refuse" | "black_hole"
    self._lock = threading.Lock()
    self._conns: set[socket.socket] = set()  # both ends of every connection
    self._listener: socket.socket | None = None
    self._accepting: threading.Thread | None = None
    self._closed = False
    self.accepted = 0  # connections accepted since start (for the tests)

  # ---- control ---------------------------------------------------------

  def start(self) -> "Proxy":
    self._listen()
    return self

  def refuse(self) -> None:
    """Stop listening and reset every connection: the port refuses."""
    with self._lock:
      self.mode = "refuse"
    self._stop_listening()
    self._reset_all()

  def black_hole(self) -> None:
    """Keep accepting, never forward a byte again (either direction)."""
    with self._lock:
      self.mode = "black_hole"

  def resume(self) -> None:
    """Forward again (on the same port); black-holed connections reset."""
    with self._lock:
      was, self.mode = self.mode, "forward"
    self._reset_all()
    if was == "refuse":
      self._listen()

  def close(self) -> None:
    self._closed = True
    self._stop_listening()
    self._reset_all()

  def __enter__(self) -> "Proxy":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()

  # ---- inside ----------------------------------------------------------

  def _listen(self) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", self.port))
    s.listen(128)
    s.settimeout(POLL_S)
    self._listener = s
    self._accepting = threading.Thread(target=self._accept_loop, args=(s,),
                                       name=f"proxy-{self.port}", daemon=True)
    self._accepting.start()

  def _stop_listening(self) -> None:
    s, self._listener = self._listener, None
    if s is not None:
      s.close()  # the accept loop sees it within POLL_S
    t, self._accepting = self._accepting, None
    if t is not None:
      t.join(5)

  def _reset_all(self) -> None:
    with self._lock:
      conns, self._conns = list(self._conns), set()
    for c in conns:
      _reset(c)

  def _accept_loop(self, listener: socket.socket) -> None:
    while self._listener is listener and not self._closed:
      try:
        client, _ = listener.accept()
      except socket.timeout:
        continue
      except OSError:
        return  # closed
      self.accepted += 1
      with self._lock:
        full = len(self._conns) >= 2 * MAX_CONNECTIONS
        mode = self.mode
      if full or mode == "refuse":
        _reset(client)
        continue
      upstream = None
      if mode == "forward":
        try:
          upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
          _reset(client)
          continue
      with self._lock:
        self._conns.add(client)
        if upstream is not None:
          self._conns.add(upstream)
      pair = _Pair(client, upstream)
      for src, dst in ((client, upstream), (upstream, client)):
        if src is not None:
          threading.Thread(target=self._pump, args=(pair, src, dst),
                           daemon=True, name=f"proxy-{self.port}-pump").start()

  def _pump(self, pair: "_Pair", src: socket.socket,
            dst: socket.socket | None) -> None:
    """Copies ``src`` to ``dst`` while forwarding, drops what arrives
    otherwise. At the end of ``src`` it half-closes ``dst`` (what was sent
    is still delivered); the pair closes once both directions ended, and is
    reset on an error."""
    ok = False
    try:
      while not self._closed:
        try:
          ready, _, _ = select.select([src], [], [], POLL_S)
        except (OSError, ValueError):
          return  # closed under us (reset)
        if not ready:
          continue
        data = src.recv(65536)
        if not data:
          if dst is not None:
            dst.shutdown(socket.SHUT_WR)
          ok = True
          return
        with self._lock:
          forward = self.mode == "forward" and dst is not None
        if forward:
          dst.settimeout(10)
          dst.sendall(data)
    except OSError:
      return
    finally:
      if pair.end(ok):
        with self._lock:
          for sock in pair.socks:
            self._conns.discard(sock)
        for sock in pair.socks:
          if ok:
            sock.close()
          else:
            _reset(sock)


class _Pair:
  """A client connection and its upstream one (None in a black hole)."""

  def __init__(self, client: socket.socket, upstream: socket.socket | None):
    self.socks = [s for s in (client, upstream) if s is not None]
    self._live = len(self.socks)
    self._lock = threading.Lock()
    self._failed = False

  def end(self, ok: bool) -> bool:
    """One direction ended; True when the pair is to be closed now (both
    ended, or this one failed)."""
    with self._lock:
      self._live -= 1
      if not ok and not self._failed:
        self._failed = True
        return True
      return self._live == 0 and not self._failed
