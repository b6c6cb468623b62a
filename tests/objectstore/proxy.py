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
- ``throttle(bytes_per_s)``: forwards at that steady rate, both directions
  and every connection together (a slow but healthy store, a saturated
  link): bytes keep moving, requests take as long as their size says.

``Proxy(target, rate=1 << 20)`` makes the store slow instead: every byte
from the clients to the store, all connections together, crosses one link
of ``rate`` bytes a second, in slices of at most ``THROTTLE_SLICE`` bytes
served first come, first served (a small request waits for the slices
queued before it, as on a saturated link, never for whole uploads).

One accept thread and two pump threads per connection, every blocking call
with a short timeout, at most ``MAX_CONNECTIONS`` open at once (more are
closed at accept): ``close()`` ends them all within a second or two.

``Proxy(target, counter=HttpCounter())`` also counts what crosses it, at
the store's door: every HTTP/1.1 request (method and path) and the bytes of
the body of each response, parsed from the two byte streams of each
connection (keep-alive, ``Content-Length`` or chunked bodies, interim 1xx
answers, HEAD). Tests read the bytes served per method and object from it
(``HttpCounter.bodies``), independently of anything ckpt or TensorStore
count. A worker process marks a moment with ``mark(endpoint, label)`` (a
request for ``/__count__/<label>``, which the counter records as a
snapshot of its counts when it arrives, and the store answers 404), so a
test can take the difference between two marks (``between``).
"""

from __future__ import annotations

import collections
import select
import socket
import struct
import threading
import time
import urllib.parse

from ckpt.multihost import local_cluster

MAX_CONNECTIONS = 256
POLL_S = 0.1
THROTTLE_SLICE = 16 << 10


class _Link:
  """A link of ``rate`` bytes a second shared by every upload: ``send``
  reserves the link's next free slot for its bytes and sleeps until they
  would have crossed it."""

  def __init__(self, rate: float):
    self.rate = float(rate)
    self._free_at = 0.0
    self._lock = threading.Lock()

  def send(self, sock: socket.socket, data: bytes) -> None:
    for i in range(0, len(data), THROTTLE_SLICE):
      part = data[i:i + THROTTLE_SLICE]
      with self._lock:
        now = time.monotonic()
        self._free_at = max(self._free_at, now) + len(part) / self.rate
        wait = self._free_at - now
      time.sleep(wait)
      sock.sendall(part)


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

  def __init__(self, target: tuple[str, int],
               counter: "HttpCounter | None" = None,
               rate: float | None = None):
    self.target = target
    self.counter = counter
    self._link = None if rate is None else _Link(rate)
    self.port = local_cluster.free_port()
    self.endpoint = f"http://127.0.0.1:{self.port}"
    self.mode = "forward"  # "forward" | "refuse" | "black_hole"
    self._lock = threading.Lock()
    self._conns: set[socket.socket] = set()  # both ends of every connection
    self._listener: socket.socket | None = None
    self._accepting: threading.Thread | None = None
    self._closed = False
    self.accepted = 0  # connections accepted since start (for the tests)
    self._pacer: _Pacer | None = None  # throttle(): the steady rate

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

  def throttle(self, bytes_per_s: float | None) -> None:
    """Forward at ``bytes_per_s`` (None: at full speed again), counting
    both directions of every connection together."""
    with self._lock:
      self._pacer = None if bytes_per_s is None else _Pacer(bytes_per_s)

  def resume(self) -> None:
    """Forward again at full speed (on the same port); black-holed
    connections reset."""
    with self._lock:
      was, self.mode, self._pacer = self.mode, "forward", None
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
      http = self.counter.connection() if self.counter is not None else None
      for src, dst, feed, link in (
          (client, upstream, http and http.feed_request, self._link),
          (upstream, client, http and http.feed_response, None)):
        if src is not None:
          threading.Thread(target=self._pump,
                           args=(pair, src, dst, feed, link), daemon=True,
                           name=f"proxy-{self.port}-pump").start()

  def _pump(self, pair: "_Pair", src: socket.socket,
            dst: socket.socket | None, feed=None,
            link: _Link | None = None) -> None:
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
        with self._lock:
          pacer = self._pacer
        data = src.recv(65536 if pacer is None else pacer.piece)
        if not data:
          if dst is not None:
            dst.shutdown(socket.SHUT_WR)
          ok = True
          return
        if pacer is not None:
          pacer.wait(len(data))
        with self._lock:
          forward = self.mode == "forward" and dst is not None
        if forward:
          if feed is not None:  # before it goes on: requests precede answers
            feed(data)
          dst.settimeout(10)
          if link is not None:
            link.send(dst, data)
          else:
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


class _Pacer:
  """A steady rate shared by every pump: each piece waits for its slot."""

  def __init__(self, bytes_per_s: float):
    if not bytes_per_s > 0:
      raise ValueError(f"bytes_per_s must be positive, got {bytes_per_s!r}")
    self.rate = float(bytes_per_s)
    # Pieces of at most 50 ms each, so the rate is steady at any scale.
    self.piece = int(min(65536, max(512, self.rate / 20)))
    self._lock = threading.Lock()
    self._next = time.monotonic()

  def wait(self, n: int) -> None:
    with self._lock:
      now = time.monotonic()
      self._next = max(self._next, now) + n / self.rate
      until = self._next
    time.sleep(max(0.0, until - time.monotonic()))


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


# ---- counting HTTP at the store's door ---------------------------------------

MARK_PREFIX = "/__count__/"


def mark(endpoint: str, label: str, timeout_s: float = 10.0) -> None:
  """Marks this moment in the HttpCounter of the proxy at ``endpoint``
  (called by a worker process once everything it counts has been read)."""
  import urllib.error  # pylint: disable=g-import-not-at-top
  import urllib.request  # pylint: disable=g-import-not-at-top
  try:
    with urllib.request.urlopen(f"{endpoint}{MARK_PREFIX}{label}",
                                timeout=timeout_s) as r:
      r.read()
  except urllib.error.HTTPError as e:  # the store's answer: 404, 403, ...
    e.read()


class HttpCounter:
  """What crossed a proxy: requests and response body bytes per (method,
  object path). ``path`` is the request path without its query, with %XX
  unquoted (a GCS download ``/download/storage/v1/b/B/o/a%2Fb`` becomes
  ``.../o/a/b``)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.requests: collections.Counter = collections.Counter()
    self.bodies: collections.Counter = collections.Counter()
    self.errors: list[str] = []  # streams it could not parse
    self.marks: dict[str, tuple[dict, dict]] = {}

  def connection(self) -> "_HttpConnection":
    return _HttpConnection(self)

  def reset(self) -> None:
    with self._lock:
      self.requests.clear()
      self.bodies.clear()
      self.errors.clear()
      self.marks.clear()

  def between(self, first: str, last: str) -> tuple[dict, dict]:
    """({(method, path): requests}, {(method, path): body bytes}) between
    two marks (each counted when its request arrived)."""
    with self._lock:
      (r0, b0), (r1, b1) = self.marks[first], self.marks[last]
    return ({k: v - r0.get(k, 0) for k, v in r1.items() if v > r0.get(k, 0)},
            {k: v - b0.get(k, 0) for k, v in b1.items() if v > b0.get(k, 0)})

  def _add(self, method: str, path: str, nbytes: int, request: bool) -> None:
    with self._lock:
      if request:
        self.requests[method, path] += 1
      else:
        self.bodies[method, path] += nbytes

  def _mark(self, label: str) -> None:
    with self._lock:
      self.marks[label] = (dict(self.requests), dict(self.bodies))

  def _error(self, text: str) -> None:
    with self._lock:
      self.errors.append(text)

  def snapshot(self) -> tuple[dict, dict]:
    """({(method, path): requests}, {(method, path): body bytes served})."""
    with self._lock:
      return dict(self.requests), dict(self.bodies)


class _HttpStream:
  """One direction of one connection: messages (head, then a body framed
  by Content-Length or chunked encoding), fed in arbitrary pieces."""

  def __init__(self, on_head, on_body):
    self._buf = b""
    self._state = "head"  # head | body | chunk-size | chunk | chunk-end | trailer | rest
    self._left = 0
    self._on_head, self._on_body = on_head, on_body

  def feed(self, data: bytes) -> None:
    self._buf += data
    while self._buf:
      if self._state == "head":
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
          return
        head, self._buf = self._buf[:end].decode("latin-1"), self._buf[end + 4:]
        lines = head.split("\r\n")
        headers = {}
        for line in lines[1:]:
          k, _, v = line.partition(":")
          headers[k.strip().lower()] = v.strip()
        framing = self._on_head(lines[0], headers)
        if framing == "chunked":
          self._state = "chunk-size"
        elif framing == "rest":
          self._state = "rest"
        elif framing:
          self._state, self._left = "body", int(framing)
      elif self._state in ("body", "chunk"):
        n = min(self._left, len(self._buf))
        self._on_body(n)
        self._buf, self._left = self._buf[n:], self._left - n
        if not self._left:
          self._state = "head" if self._state == "body" else "chunk-end"
      elif self._state == "chunk-end":
        if len(self._buf) < 2:
          return
        self._buf, self._state = self._buf[2:], "chunk-size"
      elif self._state in ("chunk-size", "trailer"):
        end = self._buf.find(b"\r\n")
        if end < 0:
          return
        line, self._buf = self._buf[:end], self._buf[end + 2:]
        if self._state == "trailer":
          if not line:
            self._state = "head"
          continue
        size = int(line.split(b";")[0].strip() or b"0", 16)
        if size:
          self._state, self._left = "chunk", size
        else:
          self._state = "trailer"
      else:  # "rest": the body runs to the end of the connection
        self._on_body(len(self._buf))
        self._buf = b""


class _HttpConnection:
  """Both directions of one proxied connection: requests are queued as they
  go up, and each final response is matched with the oldest one."""

  def __init__(self, counter: HttpCounter):
    self._counter = counter
    self._lock = threading.Lock()
    self._pending: collections.deque = collections.deque()
    self._current: tuple[str, str] | None = None
    self._up = _HttpStream(self._request_head, lambda n: None)
    self._down = _HttpStream(self._response_head, self._response_body)

  def feed_request(self, data: bytes) -> None:
    try:
      self._up.feed(data)
    except Exception as e:  # pylint: disable=broad-except
      self._counter._error(f"request stream: {e!r}")  # pylint: disable=protected-access

  def feed_response(self, data: bytes) -> None:
    try:
      self._down.feed(data)
    except Exception as e:  # pylint: disable=broad-except
      self._counter._error(f"response stream: {e!r}")  # pylint: disable=protected-access

  def _request_head(self, line: str, headers: dict):
    method, target = (line.split(" ") + ["", ""])[:2]
    path = urllib.parse.unquote(target.partition("?")[0])
    if "://" in path:  # absolute form
      path = "/" + path.split("://", 1)[1].partition("/")[2]
    with self._lock:
      self._pending.append((method, path))
    if path.startswith(MARK_PREFIX):
      self._counter._mark(path[len(MARK_PREFIX):])  # pylint: disable=protected-access
    else:
      self._counter._add(method, path, 0, request=True)  # pylint: disable=protected-access
    if headers.get("transfer-encoding", "").lower() == "chunked":
      return "chunked"
    return int(headers.get("content-length", "0") or 0)

  def _response_head(self, line: str, headers: dict):
    status = int(line.split(" ")[1])
    if 100 <= status < 200:
      return 0  # interim (100 Continue): the request is still open
    with self._lock:
      self._current = self._pending.popleft() if self._pending else ("?", "?")
    if self._current[0] == "HEAD" or status in (204, 304):
      return 0
    if headers.get("transfer-encoding", "").lower() == "chunked":
      return "chunked"
    if "content-length" in headers:
      return int(headers["content-length"])
    return "rest"

  def _response_body(self, n: int) -> None:
    if n and self._current is not None and not self._current[1].startswith(
        MARK_PREFIX):
      self._counter._add(*self._current, n, request=False)  # pylint: disable=protected-access
