"""A chunked pipeline over live prefill instances (paper §3.3; issue 16 item 3).

The conductor placed a long request on a group (``PrefillTask.cpp_stages``) and sent
it to the group's anchor, the member that holds its transactions. The anchor's worker
drives the pipeline (:func:`run_pipeline`) in place of its engine's paced compute:

    open the stages last to first    StageOpen -> stage s > 0 answers its inbox
                                     (a registered TransferEngine region + ZeroMQ)
    run them all at once             StageRun(next stage's inbox) -> each stage computes
                                     its 1/X of the layers chunk by chunk, paced by its
                                     own cost model (cost.prefill_time(b, a) / X), and
                                     writes each chunk's activations (tokens x d x
                                     elem_bytes) into the next stage's inbox
    every stage answers StageDone    the anchor writes the KV into its slots (the
                                     engine, unpaced: the stages spent the time) and
                                     ships it layer by layer to the decode node's store,
                                     and the first token streams, as for one instance

Every member serves its stages with a :class:`StageServer` beside its queue (its own
TransferEngine over TCP for the activations); the anchor's own stage is one of them. A
member computes one thing at a time (its worker's ``compute_lock``, fair): a chunk of
a stage, or a request of its own queue, so a request placed on a member while its
stage runs is computed between two chunks, as the simulator and the policy assume
(services.policy.chunk_timing). Its load report shows the chunk in progress, not the
stage's later chunks; the conductor counts the stages still to run on a member for
what is not that short.

Failure is explicit, never a hang: a stage that is not serving answers no one (NATS
"no responders": at once), a stage killed while running fails its upstream's write
(the transfer engine's error) and its downstream's wait for the next chunk (after
``timeout_s``); the first stage error fails the pipeline (:class:`PipelineError`, the
worker fails the request with it) and the other stages give up within ``timeout_s``.
"""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import zmq.asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from bus_schemas import subjects
from bus_schemas.pipeline_stages import StageDone, StageOpen, StageOpened, StageRun
from services.common import bus
from services.common.clock import Clock, SleepFn
from services.common.cost_model import CostModel
from services.common.errors import CodedError
from services.common.tasks import cancel_and_wait
from services.policy.chunk_timing import chunk_bounds
from services.prefill.cpp_stage import (
    StageError,
    StageInbox,
    StageOutbox,
    activation_nbytes,
    run_stage,
)
from services.transfer.batch_api import TransferEngine

log = structlog.get_logger()

DEFAULT_TIMEOUT_S = 10.0


class PipelineError(CodedError, RuntimeError):
    """A stage of the request's pipeline failed or is not serving."""


@dataclass
class _Open:
    msg: StageOpen
    inbox: StageInbox | None
    expiry: asyncio.TimerHandle | None = None


class StageServer:
    """One prefill instance's side of the pipelines it is a member of."""

    def __init__(
        self,
        nc: NATS,
        instance: str,
        cost: Callable[[], CostModel],
        clock: Clock,
        counters: dict[str, int],
        compute: asyncio.Lock,
        slots: int = 2,
        host: str = "127.0.0.1",
        sleep: SleepFn = asyncio.sleep,
    ) -> None:
        self.nc, self.instance, self.cost, self.clock = nc, instance, cost, clock
        self.slots, self.host = slots, host
        self._subs = bus.Subscriptions(nc)
        self._engine: TransferEngine | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._open: dict[str, _Open] = {}
        # The worker's (its stats reply): cpp_stages_run and cpp_stages_failed, once
        # there is one.
        self.counters = counters
        self.compute = compute  # the instance's one compute at a time (its worker's)
        self._chunk_ends = 0.0  # when the chunk in progress is done (clock time; 0: none)
        self._sleep = sleep

    async def start(self) -> None:
        for op, typ, handler in (
            ("open", StageOpen, self._on_open),
            ("run", StageRun, self._on_run),
        ):
            await self._subs.serve(
                subjects.cpp_stage(self.instance, op), typ, handler, concurrent=True
            )

    async def close(self) -> None:
        await self._subs.close()
        for rid in list(self._open):
            self._drop(rid)
        if self._engine is not None:
            self._engine.close()
        if self._ctx is not None:
            self._ctx.term()

    def _transport(self) -> tuple[TransferEngine, zmq.asyncio.Context]:
        if self._engine is None or self._ctx is None:
            self._engine, self._ctx = TransferEngine("tcp"), zmq.asyncio.Context()
        return self._engine, self._ctx

    def busy_s(self) -> float:
        """What is left of the stage chunk in progress here (its load report adds it, as
        the simulator's member reports the chunk it runs; the stage's later chunks
        are not queued yet)."""
        return max(0.0, self._chunk_ends - self.clock.now())

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def _chunk_bytes(self, o: StageOpen) -> int:
        return activation_nbytes(self.cost(), o.chunk_tokens)

    def _drop(self, rid: str) -> None:
        st = self._open.pop(rid, None)
        if st is None:
            return
        if st.expiry is not None:
            st.expiry.cancel()
        if st.inbox is not None:
            st.inbox.close()

    async def _fail(self, m: NatsMsg, rid: str, e: StageError) -> None:
        self._count("cpp_stages_failed")
        log.warning("cpp_stage_failed", request_id=rid, code=e.code, error=e.message)
        if m.reply:
            data, hdrs = bus.error_reply(e.code, e.message)
            await self.nc.publish(m.reply, data, headers=hdrs)

    async def _on_open(self, o: StageOpen, m: NatsMsg) -> StageOpened | None:
        if not (0 <= o.stage < o.stages and o.chunk_tokens > 0 and o.num_tokens > 0):
            await self._fail(m, o.request_id, StageError("bad_request", f"bad stage: {o}"))
            return None
        self._drop(o.request_id)
        inbox = None
        if o.stage > 0:
            engine, ctx = self._transport()
            inbox = StageInbox(engine, ctx, self._chunk_bytes(o), self.slots, self.host)
        st = self._open[o.request_id] = _Open(o, inbox)
        # An anchor that dies between open and run must not leave the inbox behind.
        st.expiry = asyncio.get_running_loop().call_later(o.timeout_s, self._drop, o.request_id)
        if inbox is None:
            return StageOpened(request_id=o.request_id, stage=o.stage)
        return StageOpened(
            request_id=o.request_id,
            stage=o.stage,
            segment=inbox.engine.segment,
            region=inbox.region,
            address=inbox.address,
        )

    async def _on_run(self, r: StageRun, m: NatsMsg) -> StageDone | None:
        rid = r.request_id
        st = self._open.get(rid)
        if st is None:
            await self._fail(m, rid, StageError("not_open", f"no stage of {rid} is open here"))
            return None
        if st.expiry is not None:
            st.expiry.cancel()
            st.expiry = None
        o, cost = st.msg, self.cost()
        outbox = None
        start = self.clock.now()
        deadline = start

        async def pace(seconds: float) -> None:  # by deadline: the bookkeeping is inside it
            nonlocal deadline
            async with self.compute:  # one chunk; the instance's own requests between
                deadline = max(deadline, self.clock.now()) + seconds
                self._chunk_ends = deadline
                try:
                    await self._sleep(max(0.0, deadline - self.clock.now()))
                finally:
                    self._chunk_ends = 0.0

        chunks = chunk_bounds(o.num_tokens, o.prefix_tokens, o.chunk_tokens)
        try:
            with structlog.contextvars.bound_contextvars(request_id=rid):
                if r.next_stage is not None:
                    engine, ctx = self._transport()
                    nxt = r.next_stage
                    outbox = StageOutbox(
                        engine,
                        ctx,
                        nxt.segment,
                        nxt.region,
                        nxt.address,
                        self._chunk_bytes(o),
                        self.slots,
                    )
                await run_stage(
                    request_id=rid,
                    stage=o.stage,
                    stages=o.stages,
                    chunks=chunks,
                    cost=cost,
                    inbox=st.inbox,
                    outbox=outbox,
                    sleep=pace,
                    timeout_s=o.timeout_s,
                    keep_output=False,
                )
        except StageError as e:
            await self._fail(m, rid, e)
            return None
        except Exception as e:  # noqa: BLE001 - e.g. the transfer engine refusing a peer
            await self._fail(m, rid, StageError("stage_failed", f"{type(e).__name__}: {e}"))
            return None
        finally:
            if outbox is not None:
                outbox.close()
            self._drop(rid)
        self._count("cpp_stages_run")
        compute = sum(cost.prefill_time(b, a) for a, b in chunks) / o.stages
        log.info("cpp_stage_done", request_id=rid, stage=o.stage, chunks=len(chunks))
        return StageDone(request_id=rid, stage=o.stage, chunks=len(chunks), compute_s=compute)


async def run_pipeline(
    nc: NATS,
    request_id: str,
    stages: list[str],
    num_tokens: int,
    prefix_tokens: int,
    chunk_tokens: int,
    expected_s: float,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[StageDone]:
    """Open and run ``request_id``'s stages on ``stages`` (pipeline order); returns each
    stage's StageDone, or raises :class:`PipelineError` with the first stage's failure.
    ``expected_s``: how long the pipeline should take (the run's replies are awaited
    that long plus ``timeout_s``)."""
    x = len(stages)
    opened: list[StageOpened | None] = [None] * x

    async def ask(s: int, op: str, msg: object, reply: type, timeout: float) -> object:
        try:
            return await bus.request(nc, subjects.cpp_stage(stages[s], op), msg, reply, timeout)
        except NoRespondersError:
            raise PipelineError(
                "stage_unavailable", f"stage {s} ({stages[s]}) is not serving"
            ) from None
        except (NatsTimeout, TimeoutError):
            raise PipelineError(
                "stage_silent", f"stage {s} ({stages[s]}) did not answer {op} in {timeout:g}s"
            ) from None
        except bus.RemoteError as e:
            raise PipelineError(e.code, f"stage {s} ({stages[s]}): {e.message}") from None

    for s in reversed(range(x)):
        open_msg = StageOpen(
            request_id=request_id,
            stage=s,
            stages=x,
            num_tokens=num_tokens,
            prefix_tokens=prefix_tokens,
            chunk_tokens=chunk_tokens,
            timeout_s=timeout_s,
        )
        got = await ask(s, "open", open_msg, StageOpened, timeout_s)
        assert isinstance(got, StageOpened)
        opened[s] = got
    runs = [
        asyncio.ensure_future(
            ask(
                s,
                "run",
                StageRun(request_id=request_id, next_stage=opened[s + 1] if s + 1 < x else None),
                StageDone,
                expected_s + timeout_s,
            )
        )
        for s in range(x)
    ]
    try:
        done, pending = await asyncio.wait(runs, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        await cancel_and_wait(runs)
    return [t.result() for t in runs]  # type: ignore[misc]
