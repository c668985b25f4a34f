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

The oldest overdue request says so late, though: the gate closes only once a backlog
has formed, opens again as soon as its oldest requests get their first tokens, and lets
the next burst in behind what is still queued (at 800 req/s on 2 cores, 573 a second
went through a 20 ms gate with a p99 of 55 ms). So the gate also caps how many requests
may wait for their first token at once (``cap``), adapted the way a TCP sender adapts
its window (AIMD, as Netflix's concurrency-limits does for servers): a first token that
came more than the limit late cuts it to 0.9 of what was waiting then (at most once per
limit's span of time: one backlog, one cut); one on time raises it by 1/cap (by one
a cap's worth of first tokens, as a TCP window grows by one a round trip), up to
``CAP_MAX``. A burst is then turned away as it arrives, by count, before it queues.
A request stuck with no token at all (a restarting service) moves neither.

The conductor's estimate is a promise a real engine breaks without the control plane
falling behind: a prefill slower than predicted makes its first token late, and the
cut would turn clients away for the engine's error, which admission already answers
for. That gate (``limit_s``) is off by default. The one on by default (``overhead_s``
alone) judges only what no engine's pace moves:
- the first token's *overhead*: the prefill worker says how much of the request's wait
  its engine accounts for (``Tokens.engine_s``: its queue, the prefix's load, the
  compute); the rest, since the gateway sent it, is the control plane's (gateway,
  admission, conductor, bus, the stores' reservation answers). One over ``overhead_s``
  is late. A first token that says nothing of the engine (decode's, when prefill does
  not stream it) moves nothing; nor does one sent before a service died
  (``disturbed``): its wait is a restart's, not a backlog's.
- what is due: a request's placement at once, while the stack places others (with
  none placed at all, an admission or conductor is restarting or starting); its first
  token only when the conductor expects it within ``overhead_s`` (an engine about to
  answer). What turns requests away is a backlog of ``BACKLOG`` overdue, not one.
  One placed with a longer engine wait is in the engine's hands: not due, and not
  counted against the cap (``counted``), since a queue the engines hold loads the
  control plane little and is admission's to bound.

Pure: the clock's time is passed in. Due times sit in a heap with lazy deletion (an
entry whose request has moved on is dropped when it reaches the top), so each
operation is O(log n) amortised."""

import heapq

CAP_MIN = 4  # requests the cap always lets wait: a stack that serves any serves these
CAP_MAX = 4096
CAP_CUT = 0.9
# Overdue requests that make a backlog (judged by the overhead): as many as the cap's
# floor lets wait, so a stack that serves any is not turned away for fewer.
BACKLOG = CAP_MIN
# A cut answers a backlog while first tokens keep coming late; this long without a late
# one, the backlog is gone, and the cap is lifted: a hiccup (a pause, a burst that
# drained) with few requests waiting must not cap the next burst for good.
CALM_S = 1.0
INF = float("inf")


class Lateness:
    """Due times of the requests still waiting for their first token; with ``limit_s``
    or ``overhead_s``, the cap on how many may wait (see module doc)."""

    def __init__(self, limit_s: float = 0.0, overhead_s: float = 0.0) -> None:
        self.limit_s = limit_s
        self.overhead_s = overhead_s
        self.cap = float(CAP_MAX)
        self._cut_at = float("-inf")
        self._late_at = float("-inf")  # the last late first token
        self._due: dict[str, float] = {}
        self._sent: dict[str, float] = {}  # when its current attempt was sent
        self._calm_from = float("-inf")  # the last service death heard of
        self._placed_at = float("-inf")  # the last placement heard of
        # Placed with an engine wait past the overhead limit (judged by it alone): in
        # the engine's hands, and not counted against the cap (see ``counted``).
        self._at_engine: set[str] = set()
        self._heap: list[tuple[float, str]] = []

    def sent(self, request_id: str, now: float) -> None:
        """A request's send: its placement is due at once. A migration's resend keeps
        what the request already owes by the estimate (``limit_s``); by the overhead it
        owes from the resend, as a dead worker is no sign of a backlog."""
        self._sent[request_id] = now
        self._at_engine.discard(request_id)
        if request_id not in self._due or not self.limit_s:
            self._set(request_id, now)

    def placed(self, request_id: str, now: float, est_ttft_s: float) -> None:
        """Its ``Accepted``: the first token is due after the conductor's estimate (not
        judged by it without ``limit_s``: then only its placement was due)."""
        if request_id in self._due:
            self._placed_at = now
            est = max(0.0, est_ttft_s)
            if self.limit_s or est <= self.overhead_s:
                self._set(request_id, now + est)
            else:
                self._set(request_id, INF)
                self._at_engine.add(request_id)

    def done(self, request_id: str) -> None:
        """It ended or failed before its first token: it owes nothing more."""
        self._due.pop(request_id, None)
        self._sent.pop(request_id, None)
        self._at_engine.discard(request_id)

    def first_token(
        self, request_id: str, now: float, engine_s: float | None = None
    ) -> float | None:
        """Its first token came (``engine_s``: the part of its wait its engine accounts
        for, when the sender said): it owes nothing more, and whether it came in time
        moves the cap. Returns its control-plane overhead, when that is known."""
        due = self._due.pop(request_id, None)
        sent = self._sent.pop(request_id, None)
        self._at_engine.discard(request_id)
        if due is None:
            return None
        overhead = None if engine_s is None or sent is None else now - sent - engine_s
        late = on_time = False
        if self.limit_s:
            late = now - due > self.limit_s
            on_time = not late
        if (
            self.overhead_s
            and overhead is not None
            and sent is not None
            and sent >= self._calm_from
        ):
            over = overhead > self.overhead_s
            late, on_time = late or over, on_time or not over
        if late:
            self._late_at = now
            if now >= self._cut_at + self._span():
                self._cut_at = now
                self.cap = max(float(CAP_MIN), min(self.cap, self.counted + 1.0) * CAP_CUT)
        elif on_time:
            self.cap = min(float(CAP_MAX), self.cap + 1.0 / self.cap)
        return overhead

    def disturbed(self, now: float) -> None:
        """A service died (or the bus lost messages): the requests waiting now wait for
        its restart, so their overhead says nothing of a backlog."""
        self._calm_from = now

    def full(self, now: float) -> bool:
        """Whether as many requests wait for their first token as the cap lets (the cap
        lifted first, once ``CALM_S`` passed without a late first token)."""
        if self.cap < CAP_MAX and now - self._late_at > CALM_S:
            self.cap = float(CAP_MAX)
        return self.capping and self.counted >= int(self.cap)

    @property
    def counted(self) -> int:
        """The requests waiting for their first token that the cap counts: all of them
        when judged by the estimate; by the overhead alone, all but those placed with an
        engine wait past its limit. Those wait in an engine's queue or compute, which
        loads the control plane little and is admission's to bound: counted, a queue
        the engines hold would cap the stack when a hiccup cut."""
        return len(self._due) - len(self._at_engine)

    @property
    def capping(self) -> bool:
        return bool(self.limit_s or self.overhead_s)

    def _span(self) -> float:
        """One backlog's span: the cap is cut at most once in it."""
        return min(x for x in (self.limit_s, self.overhead_s) if x)

    def overdue(self, now: float) -> float:
        """Seconds the most overdue request is past its due time (0 when none is).

        Judged by the overhead alone, a backlog is what is overdue, not one request:
        - the figure is the ``BACKLOG``-th most overdue request's. A backlog makes every
          later request late, one after another; one request late among others placed
          on time is a hiccup (on a loaded 2-core machine, a burst of six long prompts
          had one unplaced for 23 ms while the other five were placed);
        - an unplaced request is overdue only while the stack places others. A dead
          admission or conductor places none until it is back or its requests are
          resent, and the requests sent meanwhile wait for it, not behind each other."""
        by_overhead = self.overhead_s and not self.limit_s
        if by_overhead and now - self._placed_at > self.overhead_s:
            return 0.0
        return max(0.0, now - self._kth_due(BACKLOG if by_overhead else 1))

    def _kth_due(self, k: int) -> float:
        """The k-th earliest due time (INF with fewer than k due): the k earliest live
        entries are popped and pushed back, stale ones dropped, so O(k log n)."""
        heap, live = self._heap, {}
        while heap and len(live) < k:
            due, rid = heapq.heappop(heap)
            if self._due.get(rid) == due:
                live[rid] = due  # a duplicate entry of one request collapses here
        for rid, due in live.items():
            heapq.heappush(heap, (due, rid))
        return max(live.values()) if len(live) == k else INF

    def __len__(self) -> int:
        return len(self._due)

    def _set(self, request_id: str, due: float) -> None:
        self._due[request_id] = due
        heapq.heappush(self._heap, (due, request_id))
        if len(self._heap) > 4 * len(self._due) + 64:  # bound the stale entries
            self._heap = [(d, r) for r, d in self._due.items()]
            heapq.heapify(self._heap)
