"""A switchable worker (services.worker.role_host) on a real nats-server with fake stores:
a RoleSwitch makes it drain its prefill work, then serve as a decode instance with the
same engine."""

import asyncio
import dataclasses
import uuid

import nats
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import RoleSwitch
from bus_schemas.placement import DecodeTask, PrefillTask
from bus_schemas.requests import GenerateRequest, SamplingParams
from services.common.cost_model import CostModel
from services.common.kv_layout import KVLayout
from services.common.model_spec import ModelSpec
from services.decode import __main__ as decode_main
from services.decode.worker import DecodeWorker
from services.engine import make_engine
from services.prefill import __main__ as prefill_main
from services.prefill.reserve import Reservation
from services.prefill.worker import PrefillWorker
from services.worker.role_host import RoleHost
from services.worker.settings import WorkerSettings, make_worker
from tests.unit.conftest_fakestore import FakeNet, FakeReserver, FakeStore, handle

BUILDERS = {"prefill": prefill_main.build_prefill, "decode": decode_main.build_decode}


async def wait_until(pred, timeout: float = 5.0) -> None:
    async def loop():
        while not pred():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(loop(), timeout)


@pytest.fixture
async def host(nats_url):
    sfx = uuid.uuid4().hex[:6]
    spec = ModelSpec.from_dir()
    layout = KVLayout(spec, 32)
    gate = asyncio.Event()
    gate.set()

    async def sleep(_seconds: float) -> None:  # compute takes as long as the test wants
        await gate.wait()

    cost = CostModel(speedup=1e9)
    engine = make_engine("mock", spec, cost, sleep=sleep)
    await engine.start()
    net = FakeNet()
    pn, dn = f"p-{sfx}", f"d-{sfx}"
    store = FakeStore(net, pn, 16, layout.block_bytes)
    FakeStore(net, dn, 16, layout.block_bytes)
    nc = await nats.connect(nats_url)
    tnc = await nats.connect(nats_url)
    reserver = FakeReserver()
    settings = WorkerSettings(
        instance=f"sw-{sfx}",
        node=pn,
        layout=layout,
        cost=cost,
        report_interval=0.02,
        drain_quiet_s=0.1,
        reserver=reserver,
        builders=BUILDERS,
    )
    told: list[str] = []  # what Kubernetes would be told (services.worker.pod_role)

    async def on_role(role: str) -> None:
        told.append(role)

    h = RoleHost(nc, store, engine, "prefill", settings, on_role=on_role)
    stop = asyncio.Event()
    run = asyncio.create_task(h.run(stop))
    await asyncio.wait_for(h.serving.wait(), 5)
    h.t = dict(
        tnc=tnc,
        gate=gate,
        layout=layout,
        pn=pn,
        dn=dn,
        stop=stop,
        run=run,
        sfx=sfx,
        reserver=reserver,
        told=told,
    )
    yield h
    stop.set()
    await asyncio.wait_for(run, 10)
    await engine.stop()
    await nc.close()
    await tnc.close()


def prefill_task(h, n: int = 70) -> PrefillTask:
    t = h.t
    bb, nb = t["layout"].block_bytes, -(-n // 32)
    rid = f"req-{uuid.uuid4().hex[:6]}"
    req = GenerateRequest(
        request_id=rid,
        prompt_token_ids=[5 + i % 50 for i in range(n)],
        sampling=SamplingParams(max_tokens=2),
        block_size=32,
        reply_subject=f"test.reply.{rid}",
    )
    t["reserver"].planned[rid] = Reservation(
        prefill_tx=handle(t["pn"], range(nb), 0, bb), decode_tx=handle(t["dn"], range(nb), 0, bb)
    )
    return PrefillTask(
        request=req,
        conductor_id=f"c-{t['sfx']}",
        prefill_instance=h.settings.instance,
        decode_instance=f"dec-{t['sfx']}",
        prefill_node=t["pn"],
        decode_node=t["dn"],
    )


async def test_switch_drains_the_running_prefill_then_serves_decode(host):
    t, inst = host.t, host.settings.instance
    tnc = t["tnc"]
    seen: list[str] = []

    async def on_decode_task(m):
        seen.append("decode_task:" + decode(m.data, DecodeTask).request.request_id)

    async def on_load(m):
        role = m.subject.split(".")[-2]
        if not seen or seen[-1] != "load:" + role:
            seen.append("load:" + role)

    await tnc.subscribe(subjects.decode_tasks(f"dec-{t['sfx']}"), cb=on_decode_task)
    await tnc.subscribe(subjects.load_report("prefill", inst), cb=on_load)
    await tnc.subscribe(subjects.load_report("decode", inst), cb=on_load)
    await tnc.flush()
    await wait_until(lambda: seen == ["load:prefill"])

    t["gate"].clear()  # the prefill will sit in compute
    task = prefill_task(host)
    await tnc.publish(subjects.prefill_tasks(inst), encode(task))
    await wait_until(lambda: host.worker.queue.running is not None)

    # ignored: another instance, the role it already has, garbage
    await tnc.publish(subjects.CTL_ROLE, encode(RoleSwitch(instance="someone-else", role="decode")))
    await tnc.publish(subjects.CTL_ROLE, encode(RoleSwitch(instance=inst, role="prefill")))
    await tnc.publish(subjects.CTL_ROLE, b'{"instance": 7}')
    await tnc.publish(subjects.CTL_ROLE, encode(RoleSwitch(instance=inst, role="decode")))
    await wait_until(lambda: isinstance(host.worker, PrefillWorker) and host.worker.draining)
    assert host.role == "prefill" and host.switches == 0  # still busy with the prefill

    t["gate"].set()
    await wait_until(lambda: host.role == "decode" and host.serving.is_set())
    await wait_until(lambda: seen and seen[-1] == "load:decode")
    assert isinstance(host.worker, DecodeWorker) and host.switches == 1
    # Each role was told once, as it started serving.
    await wait_until(lambda: len(t["told"]) == 2)
    assert t["told"] == ["prefill", "decode"]
    # the queued prefill finished and was handed off before the instance changed role
    assert seen == ["load:prefill", f"decode_task:{task.request.request_id}", "load:decode"]


async def test_stop_while_draining_exits_cleanly(host):
    t, inst = host.t, host.settings.instance
    t["gate"].clear()
    await t["tnc"].publish(subjects.prefill_tasks(inst), encode(prefill_task(host)))
    await wait_until(lambda: host.worker.queue.running is not None)
    await t["tnc"].publish(subjects.CTL_ROLE, encode(RoleSwitch(instance=inst, role="decode")))
    await wait_until(lambda: host.worker.draining)
    t["stop"].set()
    t["gate"].set()
    assert await asyncio.wait_for(t["run"], 10) == 0
    assert host.role == "prefill" and not host.serving.is_set()


def test_make_worker_builds_either_role():
    spec = ModelSpec.from_dir()
    s = WorkerSettings(
        instance="i", node="n", layout=KVLayout(spec, 32), cost=CostModel(), builders=BUILDERS
    )
    engine = make_engine("mock", spec, CostModel())
    assert isinstance(make_worker("prefill", None, None, engine, s), PrefillWorker)
    assert isinstance(make_worker("decode", None, None, engine, s), DecodeWorker)
    with pytest.raises(ValueError):
        make_worker("router", None, None, engine, s)
    # without the role's builder (the entry point hands them over) there is no worker
    with pytest.raises(ValueError, match="no builder"):
        make_worker("decode", None, None, engine, dataclasses.replace(s, builders={}))


def test_both_entry_points_hand_over_both_roles_builders():
    # a switchable worker serves the other role too, whichever entry point started it
    assert prefill_main.BUILDERS == decode_main.BUILDERS == BUILDERS
