"""The bus of a stack as ``perigee up`` starts it: every service logs in as its own NATS
user (credentials drawn per run into the log directory), a client without credentials
is refused, and a worker cannot publish on another's control subjects."""

import asyncio
import json
import urllib.request
from pathlib import Path

import aiohttp
import msgspec
import nats
import nats.errors
import pytest

from bus_schemas import codec, subjects
from bus_schemas import control as bus_control
from services.common import bus
from tests.e2e.conftest import make_stack
from tests.e2e.sse import stream

pytestmark = pytest.mark.e2e


def _logins(stack) -> dict:
    return json.loads((Path(stack.cfg.log_dir) / "nats" / "credentials.json").read_text())


def _server(stack) -> str:
    return stack.nats.url  # no login in it


class Client:
    """A connection that records the server's permission errors."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc = None

    async def connect(self, url: str, user: str, password: str) -> "Client":
        async def on_error(e: Exception) -> None:
            self.errors.append(str(e))

        self.nc = await nats.connect(
            url, user=user, password=password, error_cb=on_error, allow_reconnect=False
        )
        return self

    async def denied(self, subject: str, op: str = "publish") -> bool:
        """True once the server says this publish is not allowed. The error comes on
        its own, not ordered with a flush's PONG: waited for, bounded."""
        want = f'permissions violation for {op} to "{subject}"'
        if op == "publish":
            await self.nc.publish(subject, b"{}")
        else:
            await self.nc.subscribe(subject, queue=subjects.Q_ADMISSION)
        await self.nc.flush()
        for _ in range(200):
            if any(want.lower() in e.lower() for e in self.errors):
                return True
            await asyncio.sleep(0.05)
        return False

    async def close(self) -> None:
        await self.nc.close()


async def test_a_client_without_credentials_is_refused(stack):
    with pytest.raises(nats.errors.Error) as e:
        await nats.connect(
            _server(stack), allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5
        )
    assert "authorization" in str(e.value).lower() or isinstance(
        e.value, (nats.errors.AuthorizationError, nats.errors.NoServersError)
    ), e.value
    logins = _logins(stack)
    with pytest.raises(nats.errors.Error):
        await nats.connect(
            _server(stack),
            user="gateway",
            password="not-" + logins["users"]["gateway"],
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=5,
        )


async def test_each_service_is_logged_in_as_its_own_user(stack):
    url = f"http://127.0.0.1:{stack.nats.monitor_port}/connz?auth=true&limit=1000"
    with urllib.request.urlopen(url, timeout=5) as r:
        conns = json.loads(r.read())["connections"]
    users = {c.get("authorized_user") for c in conns}
    for name in [
        "gateway",
        "admission",
        "conductor",
        "prefill-0",
        "decode-0",
        "store-p0",
        "store-d0",
    ]:
        assert name in users, (name, users)


async def test_only_the_gateway_and_admin_publish_requests(stack):
    logins = _logins(stack)["users"]
    admin = await Watcher().start(stack, subjects.REQUESTS, subjects.SCHEDULE)
    gw = await Client().connect(_server(stack), "gateway", logins["gateway"])
    dec = await Client().connect(_server(stack), "decode-0", logins["decode-0"])
    try:
        assert await dec.denied(subjects.REQUESTS)
        assert await dec.denied(subjects.SCHEDULE)
        await gw.nc.publish(subjects.REQUESTS, b"{}")  # admission answers it as bad input
        await admin.arrived(subjects.REQUESTS)
        assert admin.seen == [subjects.REQUESTS] and not gw.errors
    finally:
        for c in (gw, dec, admin):
            await c.close()


class Watcher:
    """The admin, subscribed to some subjects: what a permitted publish reaches."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def start(self, stack, *subs: str) -> "Watcher":
        self.nc = await nats.connect(stack.nats_url)

        async def cb(m) -> None:
            self.seen.append(m.subject)

        for sub in subs:
            await self.nc.subscribe(sub, cb=cb)
        await self.nc.flush()
        return self

    async def arrived(self, subject: str) -> None:
        async def loop():
            while subject not in self.seen:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(loop(), 10)

    async def close(self) -> None:
        await self.nc.close()


async def test_a_worker_cannot_publish_on_another_ones_control_subjects(stack):
    logins = _logins(stack)["users"]
    dec = await Client().connect(_server(stack), "decode-0", logins["decode-0"])
    pre = await Client().connect(_server(stack), "prefill-0", logins["prefill-0"])
    store = await Client().connect(_server(stack), "store-d0", logins["store-d0"])
    gw = await Client().connect(_server(stack), "gateway", logins["gateway"])
    cond = await Client().connect(_server(stack), "conductor", logins["conductor"])
    adm = await Client().connect(_server(stack), "admission", logins["admission"])
    denied = [
        (dec, subjects.prefill_tasks("prefill-0")),  # only the conductor places prefill
        (dec, subjects.decode_tasks("decode-0")),  # decode work comes from prefill
        (dec, subjects.load_report("prefill", "prefill-0")),  # another's load
        (dec, subjects.load_report("decode", "prefill-0")),
        (dec, subjects.worker_stats("prefill", "prefill-0")),
        (dec, subjects.CTL_ROLE),  # role switches come from the conductor
        (dec, subjects.CANCEL),  # cancels are the gateway's
        (dec, subjects.bus_reconnected("worker", "prefill-0")),  # another's notice
        (dec, subjects.bus_reconnected("gateway", "gateway")),
        (dec, "perigee.bus.reconnected"),  # the old, unattributed notice
        (dec, subjects.store_ctl("p0", "tx.renew")),  # renews only its own node's txs
        (pre, subjects.load_report("decode", "decode-0")),
        (pre, subjects.store_ctl("d0", "tx.commit")),  # the conductor settles
        (store, subjects.kv_events("p0")),  # another node's KV events
        (store, subjects.prefill_tasks("prefill-0")),
        (store, subjects.bus_reconnected("store", "p0")),
        (gw, subjects.store_ctl("d0", "tx.allocate")),
        (gw, subjects.decode_tasks("decode-0")),
        (gw, subjects.SCHEDULE),  # admission decides
        (adm, subjects.prefill_tasks("prefill-0")),
        (cond, subjects.INTAKE),
        (cond, subjects.kv_events("d0")),
        # a store announces only its own node (receivers believe the subject)
        (store, subjects.store_announce("p0")),
        (dec, subjects.store_announce("d0")),
        (pre, subjects.store_announce("p0")),
        (cond, subjects.store_announce("p0")),
        (gw, subjects.store_announce("p0")),
    ]
    # Store administration is the admin's: a wipe, a replay, object removal.
    for client in (dec, pre, store, gw, cond, adm):
        for ep in ("clear", "replay", "obj.remove", "obj.replicate"):
            denied.append((client, subjects.store_ctl("d0", ep)))
    denied += [(c, subjects.CTL_REPLICATE) for c in (dec, store, cond)]
    denied += [(c, subjects.store_ctl("d0", "dump")) for c in (dec, pre, store, gw)]
    allowed = [
        (pre, subjects.decode_tasks("nobody")),  # the hand-off to a decode instance
        (pre, subjects.store_ctl("nobody", "tx.allocate")),  # a decode node's slots
        (pre, subjects.gateway_reply("nogw", "r1")),  # tokens to a client
        (dec, subjects.load_report("decode", "decode-0")),  # its own
        (dec, subjects.bus_reconnected("worker", "decode-0")),
        (dec, "_INBOX.nobody.1"),  # a bus client's reply subject
        # the answer's write-back commits on the prefill node holding the prompt (#24)
        (dec, subjects.store_ctl("nobody", "tx.commit")),
        (store, subjects.kv_events("d0")),
        (store, subjects.store_announce("d0")),
        (cond, subjects.store_ctl("nobody", "dump")),  # it rebuilds its index so
    ]
    admin = await Watcher().start(stack, *[s for _, s in allowed])
    try:
        for client, subject in denied:
            assert await client.denied(subject), (subject, client.errors)
        for client, subject in allowed:
            await client.nc.publish(subject, b"{}")
            await admin.arrived(subject)
    finally:
        for c in (dec, pre, store, gw, cond, adm, admin):
            await c.close()


async def test_a_worker_cannot_subscribe_to_intake(stack):
    logins = _logins(stack)["users"]
    dec = await Client().connect(_server(stack), "decode-0", logins["decode-0"])
    try:
        assert await dec.denied(subjects.REQUESTS, op="subscription")
    finally:
        await dec.close()


async def test_a_worker_or_store_subscribes_to_its_own_subjects_only(stack):
    logins = _logins(stack)["users"]
    dec = await Client().connect(_server(stack), "decode-0", logins["decode-0"])
    pre = await Client().connect(_server(stack), "prefill-0", logins["prefill-0"])
    store = await Client().connect(_server(stack), "store-d0", logins["store-d0"])
    cases = [
        (c, sub)
        for c in (dec, pre, store)
        for sub in (
            "perigee.gw.>",  # every prompt and completion
            subjects.gateway_replies("*"),
            "_INBOX.>",  # every reply
            "_INBOX.gateway.>",  # another login's replies
            "_INBOX.perigee-deliver.admission",  # an intake consumer's deliveries
            "_INBOX.perigee-deliver.conductor",
            subjects.INTAKE,
            subjects.SCHEDULE,
            subjects.SCHEDULE_QUEUE,
            subjects.BUS_RECONNECTED,
            ">",
        )
    ]
    cases += [
        (dec, subjects.prefill_tasks("prefill-0")),  # another instance's tasks
        (dec, subjects.decode_tasks("decode-1")),
        (pre, subjects.decode_tasks("decode-0")),
        (pre, subjects.prefill_tasks("*")),
        (dec, subjects.prefill_reserved("prefill-0")),  # an instance's store answers
        (pre, subjects.prefill_reserved("*")),
        (store, subjects.store_ctl("p0", "tx.allocate")),  # another node's control
        (store, subjects.store_ctl("*", "clear")),
        (store, subjects.LOAD_ALL),
    ]
    try:
        for client, sub in cases:
            assert await client.denied(sub, op="subscription"), (sub, client.errors)
    finally:
        for c in (dec, pre, store):
            await c.close()


async def test_a_workers_login_reads_no_prompt_while_requests_are_served(stack):
    """decode-0's own login subscribes to every gateway stream while a request is
    served: the server refuses, and nothing of the request reaches it."""
    logins = _logins(stack)["users"]
    spy = await Client().connect(_server(stack), "decode-0", logins["decode-0"])
    got: list = []

    async def cb(m) -> None:
        got.append(m.subject)

    try:
        for sub in ("perigee.gw.>", "_INBOX.>", ">"):
            await spy.nc.subscribe(sub, cb=cb)
        await spy.nc.flush()
        async with aiohttp.ClientSession() as http:
            r = await stream(http, stack.url, {"prompt": "secret words " * 8, "max_tokens": 4})
        assert r.status == 200 and r.done, r.error
        await spy.nc.flush()
        await asyncio.sleep(0.3)
        assert got == [], got
        assert sum("permissions violation for subscription" in e.lower() for e in spy.errors) >= 3
    finally:
        await spy.close()


async def test_jetstream_api_rights_per_role(stack):
    """A worker or a store cannot touch the intake streams through the JetStream API
    (a consumer of its own would take requests off the queue), nor delete a stream;
    the roles that use a stream can."""
    logins = _logins(stack)["users"]
    dec = await Client().connect(_server(stack), "decode-0", logins["decode-0"])
    store = await Client().connect(_server(stack), "store-d0", logins["store-d0"])
    gw = await Client().connect(_server(stack), "gateway", logins["gateway"])
    denied = []
    for c in (dec, store, gw):
        for st in ("PERIGEE_INTAKE", "PERIGEE_SCHEDULE", "PERIGEE_PLACED"):
            denied += [
                (c, f"$JS.API.STREAM.INFO.{st}"),
                (c, f"$JS.API.STREAM.PURGE.{st}"),
                (c, f"$JS.API.STREAM.DELETE.{st}"),
                (c, f"$JS.API.STREAM.MSG.GET.{st}"),
                (c, f"$JS.API.CONSUMER.CREATE.{st}"),
                (c, f"$JS.API.CONSUMER.DURABLE.CREATE.{st}.admission"),
                (c, f"$JS.API.CONSUMER.MSG.NEXT.{st}.admission"),
            ]
        denied += [(c, "$JS.API.STREAM.LIST"), (c, "$JS.API.STREAM.DELETE.PERIGEE_KV_EVENTS")]
    denied += [(dec, "$JS.API.STREAM.PURGE.PERIGEE_KV_EVENTS"), (dec, "$JS.API.INFO")]
    try:
        for client, subject in denied:
            assert await client.denied(subject), (subject, client.errors)
    finally:
        for c in (dec, store, gw):
            await c.close()
    # The conductor's own login reads its stream's state through its own inbox (the KV
    # events' stream: the intake streams exist with --durable-intake only).
    ok = await nats.connect(
        _server(stack),
        user="conductor",
        password=logins["conductor"],
        inbox_prefix=bus.inbox_prefix("conductor"),
        allow_reconnect=False,
    )
    try:
        info = await ok.jetstream().stream_info("PERIGEE_KV_EVENTS")
        assert info.config.name == "PERIGEE_KV_EVENTS"
    finally:
        await ok.close()


async def test_the_login_reaches_services_through_the_environment(stack, monkeypatch):
    """What a service does with NATS_USER/NATS_PASSWORD (perigee up, Kubernetes)."""
    logins = _logins(stack)["users"]
    monkeypatch.setenv(bus.USER_ENV, "conductor")
    monkeypatch.setenv(bus.PASSWORD_ENV, logins["conductor"])
    nc = await bus.connect(_server(stack), name="probe")
    try:
        assert nc.is_connected
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def small_bus(tmp_path_factory):
    s = make_stack(
        tmp_path_factory, "small-bus", engine="mock", speedup="100", nats_max_payload=8192
    )
    s.start()
    yield s
    s.stop()


async def test_a_request_over_the_bus_max_payload_is_413_and_the_stack_serves_on(small_bus):
    s = small_bus
    async with aiohttp.ClientSession() as http:
        big = await stream(http, s.url, {"prompt": "word " * 2500, "max_tokens": 2})
        assert big.status == 413, (big.status, big.error)
        msg = big.error["error"]["message"]
        assert "max_payload of 8192 bytes" in msg and subjects.REQUESTS in msg, (
            msg
        )  # the gateway's door
        ok = await stream(http, s.url, {"prompt": "word " * 20, "max_tokens": 2})
    assert ok.status == 200 and ok.done and ok.error is None, ok.error
    assert not s.exited()


def _log_events(stack, name: str, event: str) -> list[dict]:
    out = []
    for line in (Path(stack.cfg.log_dir) / f"{name}.log").read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == event:
            out.append(rec)
    return out


async def test_a_store_cannot_announce_itself_as_another_node(stack):
    """store-d0's own login, announcing p0 at an address of its choosing: on p0's subject
    the server refuses it; on its own subject the conductor and the stores drop it (the
    payload's node is not the subject's), and p0 stays at its real address."""
    logins = _logins(stack)["users"]
    store = await Client().connect(_server(stack), "store-d0", logins["store-d0"])
    admin = await nats.connect(stack.nats_url)
    try:
        real = await bus.request(
            admin, subjects.store_ctl("p0", "info"), b"", bus_control.StoreInfo, timeout=5
        )
        fake = msgspec.structs.replace(real, data_addr="tcp://127.0.0.1:1", ts=real.ts + 1)
        assert await store.denied(subjects.store_announce("p0"))
        before = {
            n: len(_log_events(stack, n, "store_announce_impostor"))
            for n in ("conductor", "store-p0", "store-d0")
        }
        await store.nc.publish(subjects.store_announce("d0"), codec.encode(fake))
        await store.nc.flush()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while True:
            now = {n: len(_log_events(stack, n, "store_announce_impostor")) for n in before}
            if all(now[n] > before[n] for n in before):
                break
            assert loop.time() < deadline, (before, now)
            await asyncio.sleep(0.1)
        rec = _log_events(stack, "conductor", "store_announce_impostor")[-1]
        assert rec["claimed"] == "p0" and rec["subject"] == subjects.store_announce("d0")
        # p0 is still where it is (its own info)
        again = await bus.request(
            admin, subjects.store_ctl("p0", "info"), b"", bus_control.StoreInfo, timeout=5
        )
        assert again.data_addr == real.data_addr
    finally:
        await store.close()
        await admin.close()
