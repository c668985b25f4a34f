"""The one TBT rule that admission, placement and a decode instance apply (paper §4.3).
Pure.

    tbt   = cost(d).tbt_joining(running, waiting, kv_tokens, n, max_batch, seqs)
            (the token interval on decode instance d once a request of n tokens and
            ``seqs`` sequences (OpenAI's n, 1 by default) joins)
    share = tbt / TBT SLO                       (services.common.rejection.slo_share)
            an idle instance (nothing running or waiting) counts at most max_load when
            ``serve_when_idle``: the request alone gets the best TBT it can ever get
    over  = share > max_load

Early Rejection (services.admission) takes the least share over the decode pool (or
over the predicted pool) as the pool's load; the conductor rejects a placement whose
chosen decode instance is over; the paper's baseline rejects on the decode instance
(services.policy.decode_side_check) once the prefill is spent. One object, so the three
cannot drift apart.
"""

from dataclasses import dataclass

from services.common.cost_model import CostModel
from services.common.rejection import idle_capped, slo_share


@dataclass(frozen=True)
class TbtCheck:
    """The TBT rule with its load bound and its idle exemption."""

    max_load: float = 1.0
    # An idle instance takes any request (False: the paper's Algorithm 1, the simulator).
    serve_when_idle: bool = False

    @staticmethod
    def tbt(
        cost: CostModel,
        running: int,
        waiting: int,
        kv_tokens: int,
        num_tokens: int,
        max_batch: int,
        seqs: int = 1,
    ) -> float:
        """The predicted token interval once the request (``seqs`` sequences) joins."""
        return cost.tbt_joining(running, waiting, kv_tokens, num_tokens, max_batch, seqs)

    def share(self, tbt: float, slo: float, idle: bool = False) -> float:
        """``tbt`` as a share of ``slo``, an idle instance's capped at ``max_load``."""
        return idle_capped(slo_share(tbt, slo), idle and self.serve_when_idle, self.max_load)

    def over(self, tbt: float, slo: float, idle: bool = False) -> bool:
        """Whether ``tbt`` misses the SLO under this rule (a rejection)."""
        return self.share(tbt, slo, idle) > self.max_load
