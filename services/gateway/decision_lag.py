"""How far the control plane is behind: the age of the oldest request still undecided.

A request is *undecided* from its first send to admission until its ``Accepted`` (placed)
or a terminal event (an error, a rejection, its end). Admission and the conductor
decide in milliseconds when they keep up; when they do not (the services share CPUs
with everything else, so this is the whole stack saturating, not one queue), requests
wait there unanswered and every later one waits longer. The gateway then answers new
requests 429 at once (``--max-decision-lag-ms``) instead of queueing them behind a
backlog that would make them late: overload is answered before acceptance, as the
engines' overload is by admission.

Pure: a clock is passed in; insertion order is send order, so the oldest is the
first entry and every operation is O(1)."""

from collections import OrderedDict


class DecisionLag:
    """Send times of the requests that have no decision yet, oldest first."""

    def __init__(self) -> None:
        self._sent: OrderedDict[str, float] = OrderedDict()

    def sent(self, request_id: str, now: float) -> None:
        """A request's first send (a migration's resend is not a new decision to wait on)."""
        self._sent.setdefault(request_id, now)

    def decided(self, request_id: str) -> None:
        """Placed, refused, failed or gone: no longer waiting on the control plane."""
        self._sent.pop(request_id, None)

    def age(self, now: float) -> float:
        """Seconds the oldest undecided request has waited (0 when none waits)."""
        for t in self._sent.values():
            return max(0.0, now - t)
        return 0.0

    def __len__(self) -> int:
        return len(self._sent)
