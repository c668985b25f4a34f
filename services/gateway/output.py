"""Token ids -> the text a client sees: incremental detokenization plus stop strings.

Pure. :class:`StopStrings` holds back only the tail of the text that could still grow
into a stop string, so streaming is delayed by at most ``len(longest stop) - 1``
characters and only when the text actually ends like the start of one.
"""

from collections.abc import Sequence

from services.common.tokenizer import IncrementalDetokenizer


class StopStrings:
    """Finds the first stop string in streamed text; the stop string is not emitted
    unless ``include`` (vLLM's ``include_stop_str_in_output``)."""

    __slots__ = ("stops", "_buf", "include")

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self._buf = ""
        self.include = include

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was hit)."""
        buf = self._buf + text
        cut, end = -1, -1
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut, end = i, i + len(s)
        if cut != -1:
            self._buf = ""
            return buf[: end if self.include else cut], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._buf = buf[len(buf) - hold :] if hold else ""
        return (buf[: len(buf) - hold] if hold else buf), False

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return out


class TextOutput:
    """Accumulates one request's generated tokens; yields text deltas as they become safe."""

    __slots__ = ("detok", "stops", "completion_tokens", "stopped", "_next_index", "hidden")

    def __init__(
        self,
        detok: IncrementalDetokenizer,
        stops: Sequence[str] = (),
        include_stop: bool = False,
        hidden: frozenset[int] = frozenset(),
    ) -> None:
        self.detok = detok
        # The request's stop tokens: counted, never shown (vLLM leaves the token that
        # ended the answer out of its text unless include_stop_str_in_output).
        self.hidden = hidden
        self.stops = StopStrings(stops, include_stop) if stops else None
        self.completion_tokens = 0
        self.stopped = False  # a stop string was hit: ignore whatever comes next
        self._next_index = 0

    @property
    def next_index(self) -> int:
        """The index of the next generated token not yet pushed."""
        return self._next_index

    def push(self, token_ids: Sequence[int], index: int | None = None) -> str:
        """Text for ``token_ids`` (the generated tokens starting at position ``index``).
        Tokens already seen (a duplicate delivery) are skipped."""
        if self.stopped:
            return ""
        if index is not None and index < self._next_index:
            token_ids = token_ids[self._next_index - index :]
        if not token_ids:
            return ""
        self._next_index += len(token_ids)
        if self.stops is None:
            self.completion_tokens += len(token_ids)
            if self.hidden:
                token_ids = [t for t in token_ids if t not in self.hidden]
            return self.detok.push(token_ids)
        out = []
        for t in token_ids:
            self.completion_tokens += 1
            if t in self.hidden:
                continue
            emit, hit = self.stops.feed(self.detok.push((t,)))
            out.append(emit)
            if hit:
                self.stopped = True
                break
        return "".join(out)

    def finish(self) -> str:
        """Text still held back when the stream ends normally."""
        if self.stopped:
            return ""
        tail = self.detok.flush()
        if self.stops is None:
            return tail
        emit, hit = self.stops.feed(tail)
        if hit:
            self.stopped = True
            return emit
        return emit + self.stops.flush()
