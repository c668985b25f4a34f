"""The baseline's rejection point, on the decode instance (paper §4.3's starting point:
reject only once the prefill is spent)."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bus_schemas.requests import ErrorCode
from services.common.cost_model import CostModel
from services.common.rejection import Rejection
from services.common.slo_check import TbtCheck


@dataclass
class DecodeSideCheck:
    """A decode instance about to take over a prefilled request rejects it when its TBT
    with the request would exceed the TBT SLO::

        tbt = cost.tbt_joining(batch, waiting, kv_tokens, n, max_batch)
        reject (429) iff tbt > tbt_slo * max_load (and, serve_when_idle, the
                          instance is not idle)

    ``waiting`` counts requests already loading or queued on the instance (the
    request itself excluded); past ``max_batch`` (0: no cap) the sequences take turns,
    as placement and Early Rejection count them. Pure; the decode worker calls
    :meth:`check` per task.
    """

    cost: CostModel
    tbt_slo_s: float
    max_load: float = 1.0
    max_batch: int = 0  # the instance's running-batch cap (0: none)
    # An idle instance takes any request (the live worker: see
    # PlacementPolicy.serve_when_idle); False, the paper's baseline and the simulator.
    serve_when_idle: bool = False
    rejected: int = field(default=0)

    def check(
        self,
        batch_size: int,
        waiting: int,
        kv_tokens: int,
        num_tokens: int,
        tbt_slo_s: float | None = None,
        max_batch: int | None = None,
        seqs: int = 1,
    ) -> Rejection | None:
        slo = self.tbt_slo_s if tbt_slo_s is None else tbt_slo_s
        cap = self.max_batch if max_batch is None else max_batch
        rule = TbtCheck(self.max_load, self.serve_when_idle)  # admission's and placement's
        tbt = rule.tbt(self.cost, batch_size, waiting, kv_tokens, num_tokens, cap, seqs)
        if not rule.over(tbt, slo, idle=batch_size + waiting == 0):
            return None  # within the SLO, or alone on an idle instance (its best TBT)
        self.rejected += 1
        return Rejection(
            ErrorCode.REJECTED,
            f"decode instance over its TBT SLO after prefill (predicted {tbt:.4f}s > {slo:g}s)",
            1.0,
        )

    def as_admit_hook(self) -> Callable[[Any, Any, int], str | None]:
        """The DecodeWorker ``admit`` hook: (task, engine stats, tasks loading) -> reason."""

        def admit(task: Any, stats: Any, loading: int) -> str | None:
            req = task.request
            r = self.check(
                stats.batch_size,
                stats.waiting + loading,
                stats.kv_tokens,
                len(req.prompt_token_ids),
                req.tbt_slo_s,
                getattr(stats, "max_batch", None),
                req.sampling.n,
            )
            return None if r is None else r.reason

        return admit
