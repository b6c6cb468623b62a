"""An asyncio HTTP/1.1 proxy on 127.0.0.1 that makes a store misbehave in
ways a plain TCP proxy cannot (tests/objectstore/proxy.py stops or slows
every byte alike):

- ``swallow_above``: a request whose body is larger than this many bytes
  is read to its end and never answered (nor is anything else on that
  connection), while smaller requests (a lease renewal, an index, a
  listing) go through and are answered: a store that swallows large
  uploads;
- ``rate``: every byte in both directions, all connections together,
  crosses one link of ``rate`` bytes a second, in pieces of at most
  ``PIECE`` bytes served first come, first served (a small request waits
  for at most one piece per connection ahead of it). The proxy's sockets
  keep small kernel buffers (``SOCKET_BUFFER``), so the client sees its
  bytes acknowledged at the link's rate, not megabytes at once;
- ``down()`` resets every connection and refuses new ones (a store that
  went away); ``up()`` listens again on the same port.

It parses only request heads (``Content-Length`` framing, as TensorStore's
s3 and gcs drivers send); everything else is forwarded as bytes. The loop
runs on a thread of its own; ``close()`` ends it.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time

from ckpt.multihost import local_cluster

PIECE = 16 << 10
# The kernel's buffers of the proxy's sockets, and what its readers hold
# (asyncio pauses a reader at twice its limit, resumes it below): small,
# so that a client's bytes are acknowledged as they cross the link, as on
# a slow network, not in bursts of hundreds of KiB per connection.
SOCKET_BUFFER = 16 << 10


class _Link:
  """``rate`` bytes a second shared by every piece (FIFO reservations)."""

  def __init__(self, rate: float):
    self.rate = float(rate)
    self._free_at = 0.0

  async def cross(self, n: int) -> None:
    now = time.monotonic()
    self._free_at = max(self._free_at, now) + n / self.rate
    await asyncio.sleep(self._free_at - now)


class HttpProxy:
  """Forwards ``127.0.0.1:<port>`` to ``target`` (host, port)."""

  def __init__(self, target: tuple[str, int], *, rate: float | None = None,
               swallow_above: int | None = None):
    self.target = target
    self.rate = rate
    self.swallow_above = swallow_above
    self.port = local_cluster.free_port()
    self.endpoint = f"http://127.0.0.1:{self.port}"
    self.swallowed = 0   # requests read and never answered
    self.forwarded = 0   # requests passed on to the store
    # (time.monotonic(), method, path, body bytes, forwarded) of each request
    self.requests: list[tuple[float, str, str, int, bool]] = []
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever,
                                    daemon=True, name=f"httpproxy-{self.port}")
    self._server: asyncio.base_events.Server | None = None
    self._writers: set[asyncio.StreamWriter] = set()
    self._link: _Link | None = None

  # ---- control (from any thread) -----------------------------------------

  def start(self) -> "HttpProxy":
    self._thread.start()
    self._call(self._listen())
    return self

  def down(self) -> None:
    """Stop listening; reset every open connection."""
    self._call(self._down())

  def up(self) -> None:
    """Listen again on the same port."""
    self._call(self._listen())

  def close(self) -> None:
    if self._thread.is_alive():
      self._call(self._end())
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(10)

  def __enter__(self) -> "HttpProxy":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()

  def _call(self, coro) -> None:
    asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

  # ---- on the loop ---------------------------------------------------------

  async def _listen(self) -> None:
    if self.rate is not None and self._link is None:
      self._link = _Link(self.rate)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    s.bind(("127.0.0.1", self.port))
    self._server = await asyncio.start_server(self._client, sock=s,
                                              limit=PIECE)

  async def _down(self) -> None:
    if self._server is not None:
      self._server.close()
      self._server = None
    for w in list(self._writers):
      _reset(w)
    self._writers.clear()

  async def _end(self) -> None:
    await self._down()
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

  async def _cross(self, n: int) -> None:
    if self._link is not None:
      await self._link.cross(n)

  async def _client(self, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
    self._writers.add(writer)
    upstream: asyncio.StreamWriter | None = None
    answers: asyncio.Task | None = None
    try:
      while True:
        try:
          head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
          return
        size = _content_length(head)
        method, path = (head.split(b"\r\n", 1)[0].decode("latin-1").split(
            " ") + ["", ""])[:2]
        swallow = self.swallow_above is not None and size > self.swallow_above
        self.requests.append((time.monotonic(), method, path, size,
                              not swallow))
        if swallow:
          self.swallowed += 1
          while await reader.read(PIECE):  # the body, and whatever follows
            pass
          return
        if upstream is None:
          up_reader, upstream = await asyncio.open_connection(
              *self.target, limit=PIECE)
          _small_buffers(upstream)
          self._writers.add(upstream)
          answers = asyncio.ensure_future(self._pump(up_reader, writer))
        self.forwarded += 1
        await self._send(upstream, head)
        while size > 0:
          piece = await reader.read(min(size, PIECE))
          if not piece:
            return
          size -= len(piece)
          await self._send(upstream, piece)
    except (ConnectionError, OSError, asyncio.CancelledError):
      return  # (cancelled: by close(), which ends every task)
    finally:
      if answers is not None:
        answers.cancel()
      for w in (writer, upstream):
        if w is not None:
          self._writers.discard(w)
          w.close()

  async def _pump(self, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    """The store's answers, as bytes, to the client."""
    try:
      while piece := await reader.read(PIECE):
        await self._send(writer, piece)
    except (ConnectionError, OSError, asyncio.CancelledError):
      pass
    finally:
      _reset(writer)

  async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
    await self._cross(len(data))
    writer.write(data)
    await writer.drain()


def _small_buffers(writer: asyncio.StreamWriter) -> None:
  sock = writer.get_extra_info("socket")
  for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
    sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)


def _content_length(head: bytes) -> int:
  for line in head.split(b"\r\n")[1:]:
    name, _, value = line.partition(b":")
    if name.strip().lower() == b"content-length":
      return int(value.strip() or 0)
  return 0


def _reset(writer: asyncio.StreamWriter) -> None:
  """Closes with a TCP reset (SO_LINGER 0)."""
  sock = writer.get_extra_info("socket")
  try:
    if sock is not None:
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                      struct.pack("ii", 1, 0))
  except OSError:
    pass
  writer.close()
