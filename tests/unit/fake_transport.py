"""In-process fake transport backend for tests: paths that can be broken, completion by hand.

Importing it registers the backend as ``"fake"`` (``transport.register``), so a
``TransferEngine("fake", ...)`` builds one; it lives here so that nothing test-only
ships in the production package.

``FakeNetwork`` holds receivers by name (``fake://<name>``). A ``FakeSender`` cuts a
request into slices over ``paths`` like the real backends; a slice on a path in
``network.broken`` moves to the next path, and fails the request (``broken``) when
every path is broken; a target that is not registered is ``unreachable``. With
``manual=True`` slices wait in ``pending`` until ``pump()`` runs them, so tests can
see PENDING / TRANSFERRING without threads or sleeps. ``network.corrupt`` flips a byte
of every slice sent to the named targets (checksummed requests then fail).
"""

from collections import deque

from services.transfer.backends import register, slicing
from services.transfer.backends.contract import (
    Availability,
    Opcode,
    Receiver,
    Region,
    Request,
    Sender,
    Ticket,
    TransportError,
    check_span,
    crc32,
)


def available() -> Availability:
    return Availability(True)


class FakeNetwork:
    def __init__(self) -> None:
        self.receivers: dict[str, FakeReceiver] = {}
        self.broken: set[int] = set()  # path indices that fail
        self.corrupt: set[str] = set()  # receiver names whose incoming bytes get flipped
        self.log: list[tuple[str, int, int]] = []  # (target, path, nbytes) per slice done


class FakeReceiver(Receiver):
    scheme = "fake"

    def __init__(self, network: FakeNetwork, name: str) -> None:
        self.network = network
        self.name = name
        self.regions: dict[int, Region] = {}
        network.receivers[name] = self

    @property
    def address(self) -> str:
        return f"fake://{self.name}"

    def expose(self, region: Region) -> None:
        self.regions[region.id] = region

    def withdraw(self, region_id: int) -> None:
        self.regions.pop(region_id, None)

    def close(self) -> None:
        self.network.receivers.pop(self.name, None)


class FakeSender(Sender):
    scheme = "fake"

    def __init__(
        self, network: FakeNetwork, paths: int = 2, slice_bytes: int = 4, manual: bool = False
    ) -> None:
        self.network = network
        self.paths = paths
        self.slice_bytes = slice_bytes
        self.manual = manual
        self.pending: deque[tuple[Request, Ticket, slicing.Slice]] = deque()

    def submit(self, req: Request) -> Ticket:
        plan = slicing.plan(req.length, self.paths, 0, self.slice_bytes, self.slice_bytes)
        t = Ticket(req.length, len(plan))
        for p in plan:
            self.pending.append((req, t, p))
        if not self.manual:
            self.pump()
        return t

    def pump(self, n: int | None = None) -> int:
        """Run up to ``n`` pending slices (all when None); returns how many ran."""
        done = 0
        while self.pending and (n is None or done < n):
            req, t, p = self.pending.popleft()
            done += 1
            if t.done:
                continue
            t.started()
            try:
                self._run(req, t, p)
            except TransportError as e:
                t.fail(e)
        return done

    def _run(self, req: Request, t: Ticket, p: slicing.Slice) -> None:
        name = req.target.removeprefix("fake://")
        rx = self.network.receivers.get(name)
        if rx is None:
            raise TransportError("unreachable", f"no fake target {name!r}")
        path = next(
            (
                q % self.paths
                for q in range(p.path, p.path + self.paths)
                if q % self.paths not in self.network.broken
            ),
            None,
        )
        if path is None:
            raise TransportError("broken", f"all {self.paths} paths to {req.target} failed")
        region = rx.regions.get(req.region)
        off = req.offset + p.offset
        why = f"no region {req.region}" if region is None else check_span(region, off, p.length)
        if why is not None:
            raise TransportError("refused", why)
        local = req.local[p.offset : p.offset + p.length]
        remote = region.buf[off : off + p.length]
        if req.opcode == Opcode.WRITE:
            data = bytearray(local)
            if name in self.network.corrupt and data:
                data[0] ^= 0xFF
            if req.checksum and crc32(data) != crc32(local):
                raise TransportError(
                    "checksum", f"{req.target} rejected a slice: checksum mismatch"
                )
            remote[:] = data
        else:
            local[:] = remote
        self.network.log.append((req.target, path, p.length))
        t.slice_done(p.length)

    def close(self) -> None:
        for _, t, _ in self.pending:
            t.fail(TransportError("closed", "sender is closed"))
        self.pending.clear()


register("fake", available, FakeSender, FakeReceiver)
