"""Engine log-probabilities -> OpenAI's ``logprobs`` objects, as vLLM's OpenAI server
shapes them (``serving.py``'s ``_create_chat_logprobs``/``_create_completion_logprobs``).

Pure. Each position arrives as ``[token id, logprob]`` pairs in vLLM's order (the token
at the position first, then the most likely by rank; :data:`PositionLogprobs`). A token's
string is ``tokenizer.decode([id])`` with special tokens kept, as vLLM's detokenizer
makes ``decoded_token``. Chat lists the first ``top_logprobs`` pairs of each position;
completions map the first ``logprobs + 1`` pairs' strings to their logprobs, and carry a
running ``text_offset``.
"""

from collections.abc import Callable, Sequence

from bus_schemas.requests import PositionLogprobs

Decode = Callable[[int], str]


class LogprobsOut:
    """One response's logprobs, built as its tokens come (streamed or collected)."""

    __slots__ = (
        "decode",
        "chat",
        "k",
        "_offset",
        "_text_offset",
        "content",
        "tokens",
        "token_logprobs",
        "top",
    )

    def __init__(self, decode: Decode, chat: bool, k: int) -> None:
        self.decode, self.chat, self.k = decode, chat, k
        self._offset = 0
        self.content: list[dict] = []  # chat
        self.tokens: list[str] = []  # completions
        self.token_logprobs: list[float | None] = []
        self.top: list[dict[str, float] | None] = []
        self._text_offset: list[int] = []

    def add(self, ids: Sequence[int], positions: Sequence[PositionLogprobs | None]) -> dict:
        """Append ``ids`` with their positions; returns just their part (a stream chunk's
        ``logprobs``)."""
        if self.chat:
            part = [self._chat_entry(t, p) for t, p in zip(ids, positions, strict=False)]
            self.content += part
            return {"content": part}
        start = len(self.tokens)
        for t, p in zip(ids, positions, strict=False):
            tok = self.decode(t)
            self.tokens.append(tok)
            self._text_offset.append(self._offset)
            self._offset += len(tok)
            if p is None:
                self.token_logprobs.append(None)
                self.top.append(None)
                continue
            self.token_logprobs.append(_lookup(p, t))
            self.top.append({self.decode(i): lp for i, lp in p[: self.k + 1]})
        return self._completion(start)

    def body(self) -> dict:
        return {"content": self.content} if self.chat else self._completion(0)

    def _completion(self, start: int) -> dict:
        return {
            "text_offset": self._text_offset[start:],
            "token_logprobs": self.token_logprobs[start:],
            "tokens": self.tokens[start:],
            "top_logprobs": self.top[start:],
        }

    def _chat_entry(self, t: int, p: PositionLogprobs | None) -> dict:
        tok = self.decode(t)
        lp = None if p is None else _lookup(p, t)
        if lp is None:  # vLLM's entry for a token without logprobs
            return {"token": tok, "logprob": -9999.0, "bytes": _bytes(tok), "top_logprobs": []}
        top = [
            {"token": (s := self.decode(i)), "logprob": v, "bytes": _bytes(s)}
            for i, v in (p or [])[: self.k]
        ]
        return {"token": tok, "logprob": lp, "bytes": _bytes(tok), "top_logprobs": top}


def _lookup(p: PositionLogprobs, t: int) -> float | None:
    return next((lp for i, lp in p if i == t), None)


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))
