"""A lean HTTP/1.1 client for the capacity bench's open-loop load.

The bench's load generator shares the machine with the stack it measures: on 2 cores
at 400 req/s, aiohttp's client spent 0.35 ms of CPU a request (a twelfth of the
stack's own), and its request building and response parsing sat inside every
measured overhead. This client writes one POST on a kept-alive connection and parses
the reply as it arrives (an :class:`asyncio.Protocol`, no stream reader: a reply is two
or three reads): status line, headers, a body by ``Content-Length`` or chunked
transfer coding. What the bench measures is unchanged: from just before the request
is written to the arrival of the first SSE event that carries text.
"""

import asyncio
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


class HttpError(Exception):
    """A reply that is not HTTP/1.1 as the gateway writes it."""


@dataclass
class Reply:
    """What came back: the status, and of a stream, when its first text came."""

    status: int
    first_s: float = float("nan")  # seconds to the first SSE event with text
    done: bool = False  # the stream's "data: [DONE]" came
    body: bytes = b""  # a non-streamed reply's body


_HEAD, _CHUNKS, _LENGTH, _TO_EOF, _OVER = range(5)


class _Connection(asyncio.Protocol):
    """One kept-alive connection, one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buf = bytearray()
        self._state = _OVER
        self._reply = Reply(0)
        self._keep = False
        self._left = 0
        self._body: list[bytes] = []
        self._t0 = 0.0
        self._done: asyncio.Future[tuple[Reply, bool]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._state == _TO_EOF:
            self._finish(False)
        elif self._done is not None and not self._done.done():
            self._done.set_exception(EOFError("the connection closed mid-reply"))

    def send(self, data: bytes, t0: float) -> "asyncio.Future[tuple[Reply, bool]]":
        assert self.transport is not None
        self._buf.clear()
        self._state, self._reply, self._body, self._t0 = _HEAD, Reply(0), [], t0
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self._done

    def data_received(self, data: bytes) -> None:
        self._buf += data
        try:
            self._parse()
        except (HttpError, ValueError) as e:
            if self._done is not None and not self._done.done():
                self._done.set_exception(e if isinstance(e, HttpError) else HttpError(str(e)))
            self._state = _OVER
            if self.transport is not None:
                self.transport.close()

    def _parse(self) -> None:
        buf = self._buf
        if self._state == _HEAD:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            self._head(bytes(buf[:end]))
            del buf[: end + 4]
        while self._state == _CHUNKS:
            eol = buf.find(b"\r\n")
            if eol < 0:
                return
            size = int(bytes(buf[:eol]).split(b";", 1)[0], 16)
            if size == 0:
                # the last chunk: then trailers (none from the gateway) and a blank line
                end = buf.find(b"\r\n\r\n", eol) if buf[eol + 2 : eol + 4] != b"\r\n" else eol
                if end < 0:
                    return
                del buf[: end + 4]
                self._reply.body = b"".join(self._body)
                self._finish(self._keep)
                return
            if len(buf) < eol + 2 + size + 2:
                return
            self._chunk(bytes(buf[eol + 2 : eol + 2 + size]))
            del buf[: eol + 2 + size + 2]
        if self._state == _LENGTH and len(buf) >= self._left:
            self._reply.body = bytes(buf[: self._left])
            del buf[: self._left]
            self._finish(self._keep)
        elif self._state == _TO_EOF:
            self._body.append(bytes(buf))
            buf.clear()

    def _head(self, head: bytes) -> None:
        status, *lines = head.split(b"\r\n")
        parts = status.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise HttpError(f"status line {status[:80]!r}")
        self._reply.status = int(parts[1])
        keep, length, chunked = parts[0] == b"HTTP/1.1", None, False
        for line in lines:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.endswith(b"chunked")
            elif name == b"connection":
                keep = value == b"keep-alive" or (keep and value != b"close")
        self._keep = keep
        if chunked:
            self._state = _CHUNKS
        elif length is not None:
            self._state, self._left = _LENGTH, length
        else:
            self._state, self._keep = _TO_EOF, False

    def _chunk(self, data: bytes) -> None:
        r = self._reply
        if r.status != 200:
            self._body.append(data)
            return
        if r.first_s != r.first_s and b"data:" in data and b'"text"' in data:
            r.first_s = time.perf_counter() - self._t0
        if b"data: [DONE]" in data:
            r.done = True

    def _finish(self, keep: bool) -> None:
        if self._state == _TO_EOF:
            self._reply.body = b"".join(self._body)
        self._state = _OVER
        if self._done is not None and not self._done.done():
            self._done.set_result((self._reply, keep))


class LeanClient:
    """POSTs JSON to one server over a pool of kept-alive connections."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"{url!r}: an http:// address")
        self.url = url
        self._host = u.hostname
        self._port = u.port or 80
        self._authority = f"{self._host}:{self._port}".encode()
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    async def post(self, path: str, body: bytes) -> Reply:
        """POST ``body`` (JSON) to ``path`` and read the whole reply."""
        head = b"".join(
            (
                b"POST ",
                path.encode(),
                b" HTTP/1.1\r\nHost: ",
                self._authority,
                b"\r\nContent-Type: application/json\r\nContent-Length: ",
                str(len(body)).encode(),
                b"\r\n\r\n",
            )
        )
        t0 = time.perf_counter()
        conn = await self._connection()
        keep = False
        try:
            reply, keep = await conn.send(head + body, t0)
            return reply
        finally:
            if keep and not conn.closed:
                self._idle.append(conn)
            else:
                self._drop(conn)

    async def __aenter__(self) -> "LeanClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for c in list(self._open):
            self._drop(c)
        self._idle.clear()

    def _drop(self, conn: _Connection) -> None:
        self._open.discard(conn)
        if conn.transport is not None:
            conn.transport.close()

    async def _connection(self) -> _Connection:
        while self._idle:
            c = self._idle.pop()
            if not c.closed:
                return c
            self._drop(c)
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, self._host, self._port)
        self._open.add(conn)
        return conn
