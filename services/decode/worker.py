"""Decode instance: takes over a request whose KV prefill has shipped to this node,
and streams its tokens.

Lifecycle of a request on this instance:

    TransferQueue  a DecodeTask arrives once every layer has landed in decode_tx's
                   slots on this node's store (prefill awaited the acks); from here
                   this worker renews decode_tx's lease until the engine has the KV,
                   so a request waiting for a batch slot keeps its slots; the engine
                   loads the prompt KV from the slots (the mock verifies it); the
                   first token went to the client from prefill already
                   (``first_token_sent``), else it goes out now; then decode_tx is
                   committed on the store beside generation (the KV lives in the engine)
      -> WaitingQueue  inside the engine, until the running batch has room (max_batch)
      -> RunningBatch  continuous batching: Tokens as they come, then Finished; the
                   answer's blocks go into this node's store as they fill
                   (write-back, :mod:`services.decode.writeback`), all written
                   before Finished goes out

A migrated request (``request.migration``: the gateway resent it after its worker
died) is served like any other; its prompt holds the tokens already streamed, and its
context is counted as pulled from a store or recomputed (migration_kv_tokens).

CancelRequest aborts the request in the engine (Finished "abort"); a failure sends
Error to the client and RequestFailed to the conductor; shutdown fails what is
running with Error 503.

Optional ``admit`` hook (the baseline admission mode, services.common.admission_mode): asked per
arriving task before its KV is loaded; a reason rejects it with Error 429 after its
prefill was done (RequestFailed makes the conductor abort both transactions).
Role switch (§5.1, ``--switchable``): :meth:`DecodeWorker.drain` stops the load reports
and waits until every request here has finished and no task arrived for a while.
"""

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg

from bus_schemas import subjects
from bus_schemas.control import TxAbort
from bus_schemas.load import DecodeLoad
from bus_schemas.placement import DecodeTask
from bus_schemas.requests import CancelRequest, ErrorCode, Finished, Tokens
from bus_schemas.roles import Role
from services.common import bus, metrics
from services.common.errors import BadTask
from services.common.hashing import num_blocks
from services.common.kv_layout import KVLayout
from services.common.store_tx import LeaseExpired, LeaseKeeper, StoreTx
from services.decode import metrics as decode_metrics
from services.decode import sequences, writeback
from services.engine import (
    DecodeJob,
    Engine,
    EngineDeadError,
    EngineStats,
    RequestStream,
    SlotKV,
)
from services.worker import failures
from services.worker.lifecycle import WorkerBase
from services.worker.settings import WorkerSettings
from tracing import tracer

log = structlog.get_logger()


class DecodeStore(Protocol):
    """What this worker needs of services.store.client.store_client.StoreClient."""

    def slot(self, i: int) -> memoryview: ...


class _Stopped(Exception):
    """Cancelled or shut down before the request reached the running batch."""


# A decode's own failures, ahead of the ones every worker shares (services.worker.failures).
FAILURES: tuple[failures.Rule, ...] = (
    (LeaseExpired, ErrorCode.UNAVAILABLE, str),
    (
        (bus.RemoteError, nats.errors.NoRespondersError, TimeoutError),
        ErrorCode.UNAVAILABLE,
        lambda e: "decode store unavailable",
    ),
)


def classify(exc: BaseException) -> tuple[ErrorCode, str]:
    """(code, short client message) for a failed decode."""
    return failures.classify(exc, "decode", FAILURES)


class DecodeWorker(WorkerBase):
    """A decode instance: admits requests whose KV has landed and streams their tokens."""

    role = Role.DECODE
    cancelled_counter = "tasks_aborted"

    def __init__(
        self,
        nc: NATS,
        store: DecodeStore,
        engine: Engine,
        *,
        instance: str,
        node: str,
        layout: KVLayout,
        report_interval: float = 0.1,
        commit_timeout: float = 2.0,
        admit: Callable[[DecodeTask, EngineStats, int], str | None] | None = None,
        lease_s: float = 10.0,
        write_back: bool = True,
    ) -> None:
        super().__init__(nc, instance=instance, node=node, report_interval=report_interval)
        self.store = store
        self.engine = engine
        self.layout = layout
        self.commit_timeout = commit_timeout
        self.store_tx = StoreTx(nc, timeout_s=commit_timeout)
        self.leases = LeaseKeeper(self.store_tx, lease_s)
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "tasks_done",
                "tasks_failed",
                "tasks_aborted",
                "tokens_generated",
                "kv_tokens_loaded",
                "commits_failed",
                "sequences_sharing_kv",
                *writeback.COUNTERS,
            ),
            0,
        )
        self.write_back = write_back  # the answer's blocks go into this node's store
        self.admit = admit  # (task, engine stats, tasks loading) -> reason to reject
        self._subs = bus.Subscriptions(nc)
        self._active: set[str] = set()
        self._loading = 0  # requests in the TransferQueue (KV being loaded)
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop_reason: dict[str, tuple[ErrorCode, str]] = {}
        self._seqs: dict[str, int] = {}  # request id -> its sequences in the engine (n)

    # -- lifecycle --
    async def start(self) -> None:
        await self._subs.serve(
            subjects.decode_tasks(self.instance),
            DecodeTask,
            self._on_task,
            concurrent=True,
            span_name="decode.task",
        )
        await self._subs.serve(subjects.CANCEL, CancelRequest, self._on_cancel)
        await self._start_common()
        await bus.sync(self.nc)  # its subscriptions are live on the server from here
        metrics.track_worker(Role.DECODE, self, lambda: decode_metrics.sample(self))
        log.info("decode_started", instance=self.instance, node=self.node)

    async def close(self) -> None:
        """Fail every request still here with Error 503, then stop."""
        self._closing = True
        metrics.untrack_worker(Role.DECODE, self)
        for rid in list(self._active):
            self._stop_reason.setdefault(
                rid, (ErrorCode.UNAVAILABLE, "decode instance shutting down")
            )
            self._abort(rid)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=5)
        except TimeoutError:
            log.warning("decode_close_timeout", active=len(self._active))
        await self._close_common()
        await self.leases.close()
        await self._subs.close()

    async def drain(self, quiet_s: float = 0.5, poll_s: float = 0.05) -> None:
        """Before a role switch: stop reporting load, then wait until no request is
        here and no task has arrived for ``quiet_s``."""
        self.draining = True
        while self._active or time.monotonic() - self._last_task < quiet_s:
            if self.dead.is_set():
                return
            await asyncio.sleep(poll_s)

    # -- bus handlers --
    async def _on_task(self, task: DecodeTask, msg: NatsMsg) -> None:
        rid = task.request.request_id
        with structlog.contextvars.bound_contextvars(request_id=rid):
            if not await self.admit_task(task, rid, task.decode_incarnation):
                return
            if rid in self._active:
                log.warning("duplicate_decode_task")
                return
            if self.admit is not None:
                why = self.admit(task, self.engine.stats(), self._loading)
                if why:
                    log.info("rejected_after_prefill", reason=why)
                    self.counters.setdefault("tasks_rejected", 0)
                    await self._fail(task, ErrorCode.REJECTED, why, counter="tasks_rejected")
                    return
            self._active.add(rid)
            self._idle.clear()
            try:
                await self._serve(task)
            except _Stopped:
                code, message = self._stop_reason.pop(rid, (ErrorCode.CANCELLED, "cancelled"))
                counter = "tasks_aborted" if code == ErrorCode.CANCELLED else "tasks_failed"
                await self._fail(task, code, message, counter=counter)
            except Exception as e:  # noqa: BLE001 - one request's failure, not the worker's
                self._abort(rid)
                code, message = classify(e)
                log.warning("decode_failed", error=f"{type(e).__name__}: {e}", code=int(code))
                await self._fail(task, code, message)
                if isinstance(e, EngineDeadError):
                    self.dead.set()
            finally:
                self._stop_reason.pop(rid, None)
                self._seqs.pop(rid, None)
                self._active.discard(rid)
                if not self._active:
                    self._idle.set()

    async def _on_cancel(self, c: CancelRequest, msg: NatsMsg) -> None:
        rid, held = c.request_id, False
        if self.cancel_is_mine(c):
            self.remember_cancel(rid)
            held = rid in self._active
            if held:
                self._stop_reason.setdefault(rid, (ErrorCode.CANCELLED, f"cancelled: {c.reason}"))
                self._abort(rid)
        await self.ack_cancel(c, msg, held)

    def stats_counters(self) -> dict[str, int]:
        # "running" is a gauge beside the monotonic counters: requests in flight now.
        return {**super().stats_counters(), "running": len(self._active)}

    # -- one request --
    async def _serve(self, task: DecodeTask) -> None:
        req = task.request
        self._validate(task)
        wb = None
        if self.write_back:
            wb = writeback.AnswerWriteBack(
                req,
                node=self.node,
                store=self.store,  # type: ignore[arg-type]  # StoreClient
                store_tx=self.store_tx,
                block_size=self.layout.block_size,
                block_bytes=self.layout.block_bytes,
                counters=self.counters,
                lease_s=self.leases.lease_s,
                follow_node=task.prefill_node,
            )
            wb.add_tokens([task.first_token])
        try:
            await self._serve_with(task, wb)
        except BaseException:
            if wb is not None:
                wb.cancel()  # after a failure the rest of the answer is not written
            raise

    async def _serve_with(self, task: DecodeTask, wb: "writeback.AnswerWriteBack | None") -> None:
        req = task.request
        rid, n = req.request_id, len(req.prompt_token_ids)
        self._loading += 1
        try:
            with tracer().start_as_current_span("decode.load_kv", attributes={"tokens": n}):
                await self.store.attached(task.decode_tx)  # its store may have restarted
                slots = [self.store.slot(s) for s in task.decode_tx.slots]
                jobs = [
                    DecodeJob(
                        request_id=rid,
                        prompt_token_ids=req.prompt_token_ids,
                        first_token=task.first_token,
                        sampling=req.sampling,
                        kv=SlotKV(self.layout, slots, n),
                        on_block=wb.on_block if wb is not None else None,
                    ),
                    *sequences.more_jobs(req, slots, self.layout),
                ]
                self._seqs[rid] = len(jobs)
                streams = await self._before_lease_ends(self._add_all(jobs), task)
        finally:
            self._loading -= 1
        self.counters["kv_tokens_loaded"] += n
        # n > 1: the sequences after the first share the prompt's KV, shipped once by
        # prefill into one transaction on this node's store (the engine's pages the
        # first loaded, or the same slots).
        self.counters["sequences_sharing_kv"] += len(jobs) - 1
        if req.migration is not None:
            self._count_migration(task)
        if rid in self._stop_reason:  # cancelled while the KV was loading
            self._abort(rid)
            raise _Stopped()
        if not task.first_token_sent:
            with tracer().start_as_current_span("decode.first_token"):
                await self._emit(
                    req.reply_subject,
                    Tokens(
                        request_id=rid,
                        token_ids=[task.first_token],
                        index=0,
                        incarnation=self.incarnation,
                        logprobs=None if task.first_logprobs is None else [task.first_logprobs],
                        prompt_logprobs=task.prompt_logprobs,
                    ),
                )
        # The KV now lives in the engine, so the commit (which only makes the blocks
        # cacheable on this node) runs beside generation rather than before the first token.
        commit = asyncio.create_task(self._commit(task))
        if wb is not None:  # the prompt's blocks head the answer's chain
            commit.add_done_callback(lambda _: wb.prompt_committed())
        self.counters["tokens_generated"] += 1
        # One sequence whose end nothing else waits on: its last tokens ride on Finished.
        hold = (commit, wb) if len(streams) == 1 and req.finish_with_tokens else None
        with tracer().start_as_current_span("decode.generate") as span:
            ends = await asyncio.gather(
                *(
                    self._pump(req, st, seq, 1 if seq == 0 else 0, wb if seq == 0 else None, hold)
                    for seq, st in enumerate(streams)
                )
            )
            counts = [count for count, _ in ends]
            span.set_attribute("completion_tokens", sum(counts))
        await commit  # never raises; ordered before Finished so the node's cache is settled
        if wb is not None:
            with tracer().start_as_current_span("decode.writeback") as span:
                await wb.finish()
                span.set_attribute("blocks", wb.written)
        stop = self._stop_reason.get(rid)
        reasons = [st.finish_reason or "abort" for st in streams]
        if "abort" in reasons and stop is not None and stop[0] != ErrorCode.CANCELLED:
            raise _Stopped()  # shutting down: the client gets Error 503, not a short answer
        many = len(streams) > 1
        await self._emit(
            req.reply_subject,
            Finished(
                request_id=rid,
                finish_reason=reasons[0],
                prompt_tokens=n,
                completion_tokens=sum(counts),
                cached_tokens=task.cached_tokens,
                seq_finish=reasons if many else [],
                seq_tokens=list(counts) if many else [],
                tokens=ends[0][1],
            ),
        )
        self.counters["tasks_aborted" if "abort" in reasons else "tasks_done"] += 1

    async def _add_all(self, jobs: list[DecodeJob]) -> list[RequestStream]:
        """Every sequence's job into the engine: the first alone, the others once the
        engine has its KV, so that they share the prompt's pages it loaded
        (``DecodeJob.prefix_group``) rather than load the slots again. Should the first
        be over at once (its first token, prefill's, ended it), the next one leads.
        Should one fail, the others are dropped and the failure raised."""
        got: list[RequestStream | BaseException] = []
        for job in jobs:  # the lead: the first sequence that is still running
            try:
                lead = await self.engine.add_request(job)
            except Exception as e:  # noqa: BLE001 - raised below
                got.append(e)
                break
            got.append(lead)
            if not lead.done:
                break
        if len(got) < len(jobs) and not isinstance(got[-1], BaseException):
            got += await asyncio.gather(
                *(self.engine.add_request(j) for j in jobs[len(got) :]), return_exceptions=True
            )
        err = next((g for g in got if isinstance(g, BaseException)), None)
        if err is not None:
            for j, g in zip(jobs, got, strict=False):
                if not isinstance(g, BaseException):
                    self.engine.abort(j.request_id)
            raise err
        return [g for g in got if isinstance(g, RequestStream)]

    async def _pump(
        self,
        req: Any,
        stream: RequestStream,
        seq: int,
        index: int,
        wb: "writeback.AnswerWriteBack | None",
        hold: "tuple[asyncio.Task[None], writeback.AnswerWriteBack | None] | None" = None,
    ) -> tuple[int, Tokens | None]:
        """Sequence ``seq``'s tokens to the client as the engine makes them, from
        ``index`` (1: its first token went out already); returns its token count and,
        given ``hold`` (the commit and write-back that Finished waits for), the batch
        that ended the stream, once the commit is over, if the write-back has nothing
        left to write: it goes out with Finished, one message fewer, when it would
        have gone anyway (the write-back's last round could delay it: not held then)."""
        while batch := await stream.next_batch():
            ev = Tokens(
                request_id=req.request_id,
                token_ids=batch,
                index=index,
                incarnation=self.incarnation,
                logprobs=stream.take_logprobs(),
                seq=seq,
            )
            index += len(batch)
            self.counters["tokens_generated"] += len(batch)
            if wb is not None:
                wb.add_tokens(batch)
            if hold is not None and stream.ended():
                commit, hold_wb = hold
                await asyncio.shield(commit)  # Finished waits for it anyway
                if hold_wb is None or hold_wb.idle():
                    return index, ev
            await self._emit(req.reply_subject, ev)
        return index, None

    def _abort(self, rid: str) -> None:
        """Drop ``rid`` from the engine, each of its sequences when n > 1."""
        for seq_id in sequences.ids(rid, self._seqs.get(rid, 1)):
            self.engine.abort(seq_id)

    async def _before_lease_ends(self, load: Any, task: DecodeTask) -> Any:
        """``load`` (the engine taking the KV from the slots) while this worker renews the
        slots' lease. Should the lease end anyway (the store stopped answering, or lost
        the transaction in a restart), an engine that loads later would read slots the
        store may have handed to someone else, so the request fails instead."""
        tx = task.decode_tx
        key = (tx.node, tx.tx_id)
        self.leases.hold(task.request.request_id, tx.node, tx)
        try:
            # The handle's expiry dates from prefill's reservation: one that might run out
            # before the keeper's next renewal, or that names none, is renewed before it
            # is judged.
            stale = not tx.expires_at or self.leases.stale(key)
            return await self.leases.before_expiry(key, load, renew_first=stale)
        except LeaseExpired:
            self._abort(task.request.request_id)
            raise LeaseExpired(
                "the store no longer holds the request's KV for the decode engine"
            ) from None
        finally:
            self.leases.drop(*key)

    async def _commit(self, task: DecodeTask) -> None:
        with tracer().start_as_current_span("decode.commit"):
            ok = await self.store_tx.commit(
                self.node, task.decode_tx.tx_id, task.request.request_id
            )
        if not ok:
            # The store rolled the tx back (lease expired, store restarted): the blocks
            # are not cached here, nothing else is lost (StoreTx logged why).
            self.counters["commits_failed"] += 1

    # -- helpers --
    def _count_migration(self, task: DecodeTask) -> None:
        """A migrated request's context: what prefill took from a store (the prompt's
        blocks, loaded or pulled) and what it computed again (the tokens generated
        before the death, the partial last block)."""
        n = len(task.request.prompt_token_ids)
        pulled = min(task.cached_tokens, n)
        self.counters["migrated_tasks"] = self.counters.get("migrated_tasks", 0) + 1
        self.counters["migration_kv_tokens_pulled"] = (
            self.counters.get("migration_kv_tokens_pulled", 0) + pulled
        )
        self.counters["migration_tokens_recomputed"] = (
            self.counters.get("migration_tokens_recomputed", 0) + n - pulled
        )
        metrics.MIGRATION_KV_TOKENS.labels(kind="pulled").inc(pulled)
        metrics.MIGRATION_KV_TOKENS.labels(kind="recomputed").inc(n - pulled)
        log.info(
            "migrated_request_loaded",
            pulled_tokens=pulled,
            recomputed_tokens=n - pulled,
            attempt=task.request.migration.attempt if task.request.migration else 0,
        )

    def _validate(self, task: DecodeTask) -> None:
        n, bs, tx = len(task.request.prompt_token_ids), self.layout.block_size, task.decode_tx
        if n == 0:
            raise BadTask("empty prompt")
        if tx.node != self.node:
            raise BadTask(f"decode tx is on node {tx.node}, not {self.node}")
        if tx.block_bytes != self.layout.block_bytes:
            raise BadTask(
                f"decode tx blocks are {tx.block_bytes} bytes, "
                f"the model needs {self.layout.block_bytes}"
            )
        if len(tx.slots) != num_blocks(n, bs):
            raise BadTask(f"decode tx has {len(tx.slots)} slots for {n} tokens")

    async def _emit(self, subject: str, event: Any) -> None:
        if subject:
            await bus.publish(self.nc, subject, event)

    async def _fail(
        self, task: DecodeTask, code: ErrorCode, message: str, counter: str = "tasks_failed"
    ) -> None:
        req = task.request
        # The conductor may have settled this request already (the prefill side commits
        # as soon as the KV is handed over), so release the decode slots here too; a
        # second abort is refused harmlessly.
        abort = TxAbort(tx_id=task.decode_tx.tx_id, request_id=req.request_id, reason=message)
        await self._report_failure(
            req,
            task.conductor_id,
            task.prefill_node,
            task.prefill_tx_id,
            code,
            message,
            counter,
            also=((subjects.store_ctl(self.node, "tx.abort"), abort),),
        )

    def load_report(self) -> DecodeLoad:
        st = self.engine.stats()
        return DecodeLoad(
            instance=self.instance,
            node=self.node,
            batch_size=st.batch_size,
            waiting=st.waiting + self._loading,
            max_batch=self.engine.max_batch,
            kv_tokens=st.kv_tokens,
            step_time_s=st.step_time_s,
            ts=time.time(),
        )


def build_decode(nc: NATS, store: Any, engine: Any, s: WorkerSettings) -> DecodeWorker:
    """A decode worker from the worker settings (``WorkerSettings.builders``' decode)."""
    return DecodeWorker(
        nc,
        store,
        engine,
        instance=s.instance,
        node=s.node,
        layout=s.layout,
        report_interval=s.report_interval,
        commit_timeout=s.commit_timeout,
        admit=s.admit,
        lease_s=s.lease_s,
        write_back=s.write_back,
    )
