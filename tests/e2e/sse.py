"""A small OpenAI-style client for the end-to-end tests (real HTTP, real SSE)."""

import json
from dataclasses import dataclass, field

import aiohttp


@dataclass
class StreamResult:
    status: int
    chunks: list[dict] = field(default_factory=list)
    done: bool = False
    error: dict | None = None
    headers: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        out = []
        for c in self.chunks:
            for ch in c.get("choices", []):
                out.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
        return "".join(out)

    @property
    def usage(self) -> dict | None:
        for c in reversed(self.chunks):
            if c.get("usage"):
                return c["usage"]
        return None


async def stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    path: str = "/v1/completions",
    chunks: list[dict] | None = None,
) -> StreamResult:
    """Stream ``body``; ``chunks``, when given, receives the chunks as they come (for
    a task beside the stream that acts on its progress)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url + path, json=body) as r:
        res = StreamResult(status=r.status, headers=dict(r.headers))
        if chunks is not None:
            res.chunks = chunks
        if r.status != 200:
            res.error = await r.json()
            return res
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                res.done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                res.error = obj
                break
            res.chunks.append(obj)
        return res


async def post(session: aiohttp.ClientSession, url: str, body, path: str = "/v1/completions"):
    kw = {"data": body} if isinstance(body, (bytes, str)) else {"json": body}
    async with session.post(url + path, headers={"Content-Type": "application/json"}, **kw) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)
