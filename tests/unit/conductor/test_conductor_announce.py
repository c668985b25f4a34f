"""The shadow view believes a store's announce only on its node's own subject
(``perigee.store.<node>.announce``, which only that node's login may publish), and
discovery is an announce asked for, not a reply on an inbox. A real nats-server."""

import asyncio

import msgspec
import nats
import pytest

from bus_schemas import subjects
from bus_schemas.codec import encode
from services.common import bus
from services.common.clock import ManualClock
from services.conductor.shadow import ShadowView
from tests.unit.conductor.test_conductor_dead_store import info

pytestmark = pytest.mark.timeout(60)


async def test_an_announce_is_believed_only_on_its_own_nodes_subject(nats_url):
    nc = await nats.connect(nats_url)
    subs = bus.Subscriptions(nc)
    view = ShadowView(nc, subs, ManualClock(0.0), replay_timeout_s=5.0)

    async def discovered(_m) -> None:  # n1 answers a discovery as a store does
        await nc.publish(subjects.store_announce("n1"), encode(info("n1")))
        # and an impostor: its own subject, another node's name
        await nc.publish(subjects.store_announce("n2"), encode(info("n9")))

    await nc.subscribe(subjects.STORE_DISCOVER, cb=discovered)
    try:
        await view.start(discover_window_s=0.1)
        await asyncio.wait_for(view.caught_up.wait(), 10)
        # The window only bounds how long discovery listens: wide enough for a loaded
        # box to answer within it (n1 answers at once; the impostor's answer is refused).
        found = await view.discover(3.0)
        assert found == ["n1"]
        assert view.stores.known("n1") and not view.stores.known("n9")
        # a periodic announce: the same rule
        bad = msgspec.structs.replace(info("n7"), data_addr="tcp://evil:1")
        await nc.publish(subjects.store_announce("n8"), encode(bad))
        await nc.publish(subjects.store_announce("n6"), encode(info("n6")))
        await nc.flush()
        for _ in range(500):  # n6 was published after n7 on one connection: in order
            if view.stores.known("n6"):
                break
            await asyncio.sleep(0.02)
        assert view.stores.known("n6") and not view.stores.known("n7")
    finally:
        await subs.close()
        await nc.close()


def test_the_announce_subject_names_its_node():
    assert subjects.store_announce("p0") == "perigee.store.p0.announce"
    assert subjects.STORE_ANNOUNCE == "perigee.store.*.announce"
    assert subjects.announced_by("perigee.store.p0.announce", "p0")
    for subject, node in (
        ("perigee.store.p1.announce", "p0"),
        ("perigee.store.p0.info", "p0"),
        ("perigee.store.announce", "p0"),
        ("perigee.store.p0.announce", ""),
    ):
        assert not subjects.announced_by(subject, node)
    # telemetry: announces are not traced
    assert not bus.traced_subject(subjects.store_announce("p0"))
    assert not bus.traced_subject(subjects.STORE_ANNOUNCE)
    assert bus.traced_subject(subjects.store_ctl("p0", "info"))
