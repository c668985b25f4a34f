"""A lean HTTP/1.1 client for the capacity bench's open-loop load.

The bench's load generator shares the machine with the stack it measures: on 2 cores
at 400 req/s, aiohttp's client spent 0.37 ms of CPU a request (a twelfth of the
stack's own), and its request building and response parsing sat inside every
measured overhead. This client writes one POST and reads the reply off a kept-alive
connection with asyncio's streams, nothing more: status line, headers, a body by
``Content-Length`` or chunked transfer coding. What the bench measures is unchanged:
from just before the request is written to the first SSE event that carries text.
"""

import asyncio
import time
from dataclasses import dataclass, field
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


@dataclass
class LeanClient:
    """POSTs JSON to one server over a pool of kept-alive connections."""

    url: str
    _idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = field(default_factory=list)
    _open: set[asyncio.StreamWriter] = field(default_factory=set)

    def __post_init__(self) -> None:
        u = urlsplit(self.url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"{self.url!r}: an http:// address")
        self._host = u.hostname
        self._port = u.port or 80
        self._authority = f"{self._host}:{self._port}".encode()

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
        reader, writer = await self._connection()
        reuse = False
        try:
            writer.write(head + body)
            reply, reuse = await _read_reply(reader, t0)
            return reply
        finally:
            if reuse:
                self._idle.append((reader, writer))
            else:
                self._open.discard(writer)
                writer.close()

    async def close(self) -> None:
        for w in list(self._open):
            w.close()
        self._open.clear()
        self._idle.clear()

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            r, w = self._idle.pop()
            if not w.is_closing() and not r.at_eof():
                return r, w
            self._open.discard(w)
            w.close()
        r, w = await asyncio.open_connection(self._host, self._port)
        self._open.add(w)
        return r, w


async def _read_reply(reader: asyncio.StreamReader, t0: float) -> tuple[Reply, bool]:
    """The reply, and whether its connection can carry another request."""
    line = await reader.readline()
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise HttpError(f"status line {line[:80]!r}")
    reply = Reply(int(parts[1]))
    length: int | None = None
    chunked = False
    keep = parts[0] == b"HTTP/1.1"
    while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = h.partition(b":")
        name = name.strip().lower()
        value = value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = value.endswith(b"chunked")
        elif name == b"connection":
            keep = value == b"keep-alive" or (keep and value != b"close")
    if chunked:
        await _read_chunks(reader, reply, t0)
    elif length is not None:
        reply.body = await reader.readexactly(length)
    else:  # delimited by the connection's end
        reply.body = await reader.read()
        keep = False
    return reply, keep


async def _read_chunks(reader: asyncio.StreamReader, reply: Reply, t0: float) -> None:
    body = []
    while True:
        size = int((await reader.readline()).split(b";", 1)[0], 16)
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            break
        data = (await reader.readexactly(size + 2))[:-2]
        if reply.status != 200:
            body.append(data)
            continue
        if reply.first_s != reply.first_s and b"data:" in data and b'"text"' in data:
            reply.first_s = time.perf_counter() - t0
        if b"data: [DONE]" in data:
            reply.done = True
    reply.body = b"".join(body)
