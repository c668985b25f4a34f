"""How far behind its own promises the stack is: the most overdue first token.

A request waits for its first token. Until it is placed, the control plane owes an
answer at once (admission and the conductor decide in milliseconds when they keep up);
once placed, its ``Accepted`` carries the conductor's TTFT estimate (queue + prefill),
and the first token is due then. A request still waiting past that is *overdue*. When
every service keeps up, nothing is overdue by more than the estimate's error; when the
machine saturates (the services share CPUs, so a backlog anywhere, in admission, the
conductor, a prefill worker's event loop or a store, slows all of them), requests wait
past their due times and every later one waits longer. The gateway then answers new
requests 429 at once (``--max-lateness-ms``) instead of queueing them behind that
backlog: overload is answered before acceptance, as the engines' overload is by
admission.

Pure: the clock's time is passed in. Due times sit in a heap with lazy deletion (an
entry whose request has moved on is dropped when it reaches the top), so each
operation is O(log n) amortised."""

import heapq


class Lateness:
    """Due times of the requests still waiting for their first token."""

    def __init__(self) -> None:
        self._due: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []

    def sent(self, request_id: str, now: float) -> None:
        """A request's first send: its placement is due at once (a migration's resend
        keeps what the request already owes)."""
        if request_id not in self._due:
            self._set(request_id, now)

    def placed(self, request_id: str, now: float, est_ttft_s: float) -> None:
        """Its ``Accepted``: the first token is due after the conductor's estimate."""
        if request_id in self._due:
            self._set(request_id, now + max(0.0, est_ttft_s))

    def done(self, request_id: str) -> None:
        """Its first token came, or it ended or failed: it owes nothing more."""
        self._due.pop(request_id, None)

    def overdue(self, now: float) -> float:
        """Seconds the most overdue request is past its due time (0 when none is)."""
        heap = self._heap
        while heap and self._due.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return max(0.0, now - heap[0][0]) if heap else 0.0

    def __len__(self) -> int:
        return len(self._due)

    def _set(self, request_id: str, due: float) -> None:
        self._due[request_id] = due
        heapq.heappush(self._heap, (due, request_id))
        if len(self._heap) > 4 * len(self._due) + 64:  # bound the stale entries
            self._heap = [(d, r) for r, d in self._due.items()]
            heapq.heapify(self._heap)
