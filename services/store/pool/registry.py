"""The node registry as one store sees it: which stores exist, at which data address.

Fed by the StoreInfo announcements on the bus (``perigee.store.<node>.announce``, each
believed only on its own node's subject: the service checks that before :meth:`seen`).
A SHIP, PULL or LEASE goes only to an address a store announced (:meth:`NodeRegistry.knows`,
which waits a little for the announcement of a store that just started); a store's
older address is forgotten once it announces a new one (a restart), and an address not
announced for ``stale_s`` is no longer known.

The check is on once the store has heard its own announcement: that is what says its
login may read the announcements at all (a bus that does not let it would otherwise
refuse every ship); until then :meth:`knows` says yes and ``enforced`` is False.
"""

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from bus_schemas.control import StoreInfo

log = structlog.get_logger()


@dataclass
class _Entry:
    node: str
    epoch: int
    seen: float
    ctl_path: str = ""


class NodeRegistry:
    """Which stores exist and at which data address, as their announcements say."""

    def __init__(
        self,
        own_node: str,
        *,
        wait_s: float = 3.0,
        stale_s: float = 30.0,
        max_nodes: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.own_node = own_node
        self.wait_s = wait_s
        self.stale_s = stale_s
        self.max_nodes = max_nodes
        self.clock = clock
        self.enforced = False
        self._by_addr: OrderedDict[str, _Entry] = OrderedDict()
        self._addr_of: dict[str, str] = {}
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._by_addr)

    def seen(self, info: StoreInfo) -> None:
        """A StoreInfo announcement arrived."""
        if not info.data_addr or not info.node:
            return
        old = self._addr_of.get(info.node)
        if old is not None and old != info.data_addr:
            prev = self._by_addr.get(old)
            if prev is not None and prev.node == info.node:
                del self._by_addr[old]  # its previous incarnation's address (not another's)
        self._addr_of[info.node] = info.data_addr
        self._by_addr[info.data_addr] = _Entry(info.node, info.epoch, self.clock(), info.ctl_path)
        self._by_addr.move_to_end(info.data_addr)
        while len(self._by_addr) > self.max_nodes:
            gone_addr, gone = self._by_addr.popitem(last=False)
            if self._addr_of.get(gone.node) == gone_addr:
                self._addr_of.pop(gone.node, None)
        if info.node == self.own_node and not self.enforced:
            self.enforced = True
            log.info("node_registry_enforced", stores=len(self._by_addr))
        self._changed.set()
        self._changed = asyncio.Event()

    def known_now(self, addr: str) -> bool:
        e = self._by_addr.get(addr)
        return e is not None and self.clock() - e.seen <= self.stale_s

    def ctl_path(self, addr: str) -> str:
        """The Unix socket the store at ``addr`` announced ('' if none or not known): its
        peers on the same host send it their OPEN and CLOSE there."""
        e = self._by_addr.get(addr)
        return e.ctl_path if e is not None and self.clock() - e.seen <= self.stale_s else ""

    async def knows(self, addr: str) -> bool:
        """Whether ``addr`` is a known store's data address (waiting up to ``wait_s`` for
        its announcement)."""
        if not self.enforced:
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while not self.known_now(addr):
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return self.known_now(addr)
        return True
