"""How many bytes of data this process has moved to and from its stores, for
the stall bound of ckpt/store/deadline.py: a number that grows while data
moves and never grows for a lease renewal.

Two measures, added:

- completed requests, as TensorStore's base kvstore drivers count them
  (``/tensorstore/kvstore/<driver>/bytes_written`` and ``bytes_read``,
  counted when a request completes; drivers that read and write through
  another kvstore, ocdbt, are left out so nothing counts twice);
- bytes in flight on the wire (Linux): the bytes acknowledged by the peer
  and received from it (``TCP_INFO``'s ``bytes_acked`` and
  ``bytes_received``) on this process's TCP connections to the endpoints of
  the object stores it opened (``watch``): a request that takes longer than
  the bound, a 16 MiB chunk through 1 MiB/s, counts as it goes. TensorStore
  counts no bytes before a request completes (checked with 0.1.86: its
  ``/tensorstore/http/request_bytes`` is a histogram recorded as a request
  starts), so the sockets are read directly: every file descriptor of the
  process that is a TCP socket whose peer is such an endpoint (the
  endpoint's addresses as resolved when it was watched, or an HTTP(S)
  proxy the environment names).

A lease renewal (ckpt/commit/renewal.py) is not progress of the save it
keeps alive: a store that swallows large uploads but answers small ones
would keep the save alive forever. Each of its requests is announced
before it is sent (``aside``), with more bytes than it can move (its body
twice, plus ``ASIDE_OVERHEAD`` for headers and TLS), and ``moved()`` is the
measures less everything announced so: a renewal lowers it at most, data
raises it. A caller takes "moved more than ever before" as progress; so
after each renewal (one every ``lease_s / 6``) the data has to make up the
renewal's unused allowance, some 17 KiB, before it counts again: a save
moving less than about 4 KiB/s (lease_s 30) is taken for stalled.

Both measures are per process, not per operation: while two operations of
this process move data through the same driver or to the same endpoint at
once, each sees the other's bytes. A store reached through a name whose
addresses change (DNS rotation) may be reached at an address not resolved
here; its bytes in flight are then not seen, and only completed requests
count for it (the granularity before this module).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import threading
import time
import urllib.parse

import tensorstore as ts

_BYTES = ("/bytes_written", "/bytes_read")
_ADAPTERS = ("ocdbt",)  # read and write through a base kvstore, counted there
# Headers, signatures and TLS records of one announced request, both ways.
ASIDE_OVERHEAD = 16 << 10
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked, tcpi_bytes_received.
_TCP_INFO_BYTES = 120
_TCP_INFO_LEN = 136
_SCAN_S = 0.1  # a scan of the sockets serves every caller for this long
_DEFAULT_HOSTS = {"s3": "s3.amazonaws.com", "gcs": "storage.googleapis.com"}


class _Traffic:
  """The process's measures (one instance, ``_TRAFFIC``)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._peers: set[tuple[str, int]] = set()
    self._watched: set[tuple[str, int]] = set()
    self._sockets: dict[int, int] = {}  # inode -> bytes seen on it
    self._kinds: dict[int, bool | int] = {}  # see _scan
    self._wire = 0
    self._scanned = -1.0
    self._aside = 0

  def watch(self, host: str, port: int) -> None:
    """Adds the addresses of ``host`` to the peers, resolved on a thread
    of its own (a slow resolver never holds up the caller)."""
    with self._lock:
      if (host, port) in self._watched:
        return
      self._watched.add((host, port))
    try:  # an address already: no resolver
      self._resolve(host, port, socket.AI_NUMERICHOST)
    except OSError:
      threading.Thread(target=self._resolve, args=(host, port), daemon=True,
                       name="ckpt-traffic-resolve").start()

  def _resolve(self, host: str, port: int, flags: int = 0) -> None:
    try:
      infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP,
                                 flags=flags)
    except OSError:
      if flags:
        raise
      return  # unknown: its bytes in flight are not seen
    with self._lock:
      self._peers.update((info[4][0], port) for info in infos)
      self._kinds.clear()  # a socket found no peer may be one now

  def aside(self, nbytes: int) -> None:
    with self._lock:
      self._aside += 2 * max(0, int(nbytes)) + ASIDE_OVERHEAD

  def moved(self, on_wire: bool = True) -> int:
    data = _completed() + (self._on_wire() if on_wire else 0)
    # Read last: a renewal's bytes in ``data`` were announced before it was
    # sent, so before they were counted; one announced since lowers it.
    with self._lock:
      return data - self._aside

  def _on_wire(self) -> int:
    with self._lock:
      now = time.monotonic()
      if not self._peers or now - self._scanned < _SCAN_S:
        return self._wire
      self._scanned = now
      seen = _scan(self._peers, self._kinds)
      # A connection first seen now is new since the last scan: all of its
      # bytes moved since.
      self._wire += sum(max(0, n - self._sockets.get(inode, 0))
                        for inode, n in seen.items())
      self._sockets = seen
      return self._wire


_TRAFFIC = _Traffic()


def watch(spec: dict) -> None:
  """Counts the bytes in flight to the store of the kvstore ``spec`` (s3,
  gcs; an ``endpoint`` member or TensorStore's environment variable, else
  the public endpoint; an HTTP(S) proxy named by the environment too)."""
  driver = spec.get("driver")
  if driver not in _DEFAULT_HOSTS:
    return
  urls = []
  if driver == "s3" and spec.get("endpoint"):
    urls.append(spec["endpoint"])
  elif driver == "s3":  # virtual-host names, global and regional
    bucket, region = spec.get("bucket"), spec.get("aws_region")
    urls += [f"https://{_DEFAULT_HOSTS['s3']}",
             f"https://{bucket}.{_DEFAULT_HOSTS['s3']}"]
    if region:
      urls += [f"https://s3.{region}.amazonaws.com",
               f"https://{bucket}.s3.{region}.amazonaws.com"]
  else:
    urls.append(os.environ.get("TENSORSTORE_GCS_HTTP_URL")
                or f"https://{_DEFAULT_HOSTS['gcs']}")
  for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY",
               "all_proxy", "ALL_PROXY"):
    if os.environ.get(name):
      urls.append(os.environ[name])
  for url in urls:
    parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parsed.hostname:
      try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
      except ValueError:
        continue
      _TRAFFIC.watch(parsed.hostname, port)


def aside(nbytes: int) -> None:
  """A request that is not data (a lease renewal) is about to move a body
  of ``nbytes``: ``moved()`` discounts it (module docstring)."""
  _TRAFFIC.aside(nbytes)


def moved(on_wire: bool = True) -> int:
  """Bytes of data moved so far, less what was announced ``aside``: it
  grows while data moves; compare it with the largest value seen before.
  ``on_wire=False`` (an operation on a local disk): completed requests
  only, no scan of the sockets (which costs a listing of the process's
  sockets and its TCP table, 1.8 MiB of Python objects per disk save once
  a bucket had been opened in the process)."""
  return _TRAFFIC.moved(on_wire)


def _completed() -> int:
  """Bytes TensorStore's base kvstore drivers of this process wrote and
  read in completed requests (0 where it has no metrics)."""
  try:
    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
  except Exception:  # pylint: disable=broad-except
    return 0
  total = 0
  for m in metrics:
    name = m["name"]
    if not name.endswith(_BYTES) or name.split("/")[3] in _ADAPTERS:
      continue
    total += sum(int(v.get("value", 0)) for v in m["values"])
  return total


def _scan(peers: set[tuple[str, int]], kinds: dict[int, bool | int]
          ) -> dict[int, int]:
  """{socket inode: bytes acknowledged + received} of this process's TCP
  connections to ``peers`` (empty where there is no /proc or TCP_INFO).

  ``kinds`` remembers, per socket inode of the process, whether it is a
  connection to a peer (True) or not (False), or how many scans did not
  find it connected yet (an int): /proc/self/net/tcp lists every socket
  of the network namespace and takes milliseconds to read (16 ms with
  340), so it is read only when the process has a socket not known yet.
  A socket found unconnected twice (a Unix socket, a listening one) is
  known to be no connection to a store; once is not enough, since curl
  creates a socket before it connects it.

  The connections are found in /proc/self/net/tcp{,6} (by inode and
  peer) before any socket object is made, and the flags of the ones made
  are put back: making one of a descriptor sets it non-blocking when
  ``socket.setdefaulttimeout`` was called, and a duplicate shares that
  flag with the original."""
  mine: dict[int, str] = {}  # inode -> descriptor
  try:
    fds = os.listdir("/proc/self/fd")
  except OSError:
    return {}
  for name in fds:
    try:
      link = os.readlink(f"/proc/self/fd/{name}")
    except OSError:
      continue  # closed meanwhile
    if link.startswith("socket:["):
      mine[int(link[8:-1])] = name
  for inode in [i for i in kinds if i not in mine]:
    del kinds[inode]  # closed
  unknown = [i for i in mine if not isinstance(kinds.get(i), bool)]
  if unknown:
    connected = dict(_connections())
    for inode in unknown:
      peer = connected.get(inode)
      if peer is not None and peer[1] != 0:
        kinds[inode] = peer in peers
      else:
        misses = kinds.get(inode, 0) + 1
        kinds[inode] = False if misses >= 2 else misses
  wanted = {i: name for i, name in mine.items() if kinds.get(i) is True}
  out: dict[int, int] = {}
  for inode, name in wanted.items():
    try:
      fd = os.dup(int(name))
    except OSError:
      continue
    if os.fstat(fd).st_ino != inode:  # closed and reused since
      os.close(fd)
      continue
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
      sock = socket.socket(fileno=fd)
    except OSError:
      os.close(fd)
      continue
    try:
      if fcntl.fcntl(fd, fcntl.F_GETFL) != flags:  # (see the docstring)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
      info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO,
                             _TCP_INFO_LEN)
      if len(info) >= _TCP_INFO_LEN:
        acked, received = struct.unpack_from("QQ", info, _TCP_INFO_BYTES)
        out[inode] = acked + received
    except OSError:
      continue
    finally:
      sock.close()
  return out


def _connections():
  """(inode, (peer address, peer port)) of every TCP socket in this
  process's network namespace (/proc/self/net/tcp and tcp6)."""
  for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
    try:
      with open(f"/proc/self/net/{table}") as f:
        lines = f.read().splitlines()[1:]
    except OSError:
      continue
    for line in lines:
      fields = line.split()
      try:
        address, port = fields[2].split(":")
        raw = bytes.fromhex(address)
        # Each 32-bit word in the host's byte order.
        words = struct.unpack(f"={len(raw) // 4}I", raw)
        packed = struct.pack(f"!{len(words)}I", *words)
        peer = socket.inet_ntop(family, packed)
        if family == socket.AF_INET6 and peer.startswith("::ffff:"):
          peer = peer[7:]  # an IPv4 peer of a dual-stack socket
        yield int(fields[9]), (peer, int(port, 16))
      except (IndexError, ValueError, OSError):
        continue
