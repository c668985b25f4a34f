"""Same-host shared-memory backend: the initiator maps the target's segments and copies.

A :class:`ShmReceiver` publishes a small descriptor (``/dev/shm/perigee-seg-<token>.json``:
region id -> shared-memory name, base offset, size) and advertises ``shm://<token>``.
A :class:`ShmSender` reads the descriptor once, maps each named segment (its owner maps
the pages: services.common.prefault), and serves a request with one memcpy: no socket,
no kernel copy. The copy runs on the submitting thread (the ticket has ended when
``submit`` returns): handing it to a thread costs a wake-up that, on a busy host, takes
longer than copying megabytes; requests of ``inline_below`` bytes or more go to the copy
thread instead, for callers that must not block. A copy of ``split_min`` bytes or more
is cut in ``split_threads + 1`` parts, copied at once by the copying thread and that
many helper threads: one core copies cold memory at ~9 GB/s here, two at ~13 (one
thread copying memory that is still in cache, as a memcpy benchmark repeating itself
does, reaches ~15).
Mapped segments are pooled per target (SIEVE, capped) like network endpoints.

Only regions registered with a shared-memory ``name`` can be exposed this way.
"""

import contextlib
import json
import mmap
import os
import queue
import secrets
import threading

import numpy as np

from services.transfer.backends.contract import (
    Availability,
    Opcode,
    Receiver,
    Region,
    Request,
    Sender,
    Ticket,
    TransportError,
    crc32,
)
from services.transfer.backends.sieve import SievePool

SEG_DIR = "/dev/shm"


def available() -> Availability:
    if not os.path.isdir(SEG_DIR):
        return Availability(False, f"{SEG_DIR} does not exist (no POSIX shared memory)")
    return Availability(True)


def _descriptor_path(token: str) -> str:
    return os.path.join(SEG_DIR, f"perigee-seg-{token}.json")


def sweep_stale(seg_dir: str = SEG_DIR) -> int:
    """Remove what stores killed with SIGKILL left in ``seg_dir``: a descriptor none of
    whose segments exists any more, and a store's local socket (``<arena>.ctl``) whose
    arena is gone (a dead store's resource tracker unlinks its arena, not these). Judged
    by the segments, not by process ids, so a store in another PID namespace sharing
    this ``/dev/shm`` keeps its files. Returns how many files went."""
    try:
        names = os.listdir(seg_dir)
    except OSError:
        return 0
    present = set(names)
    gone = 0
    for name in names:
        if name.startswith("perigee-seg-") and name.endswith(".json"):
            try:
                with open(os.path.join(seg_dir, name)) as f:
                    segments = {str(d["name"]).lstrip("/") for d in json.load(f).values()}
            except (OSError, ValueError, TypeError, KeyError, AttributeError):
                continue  # being written, or not ours to judge
            stale = bool(segments) and not segments & present
        elif name.startswith("perigee_") and name.endswith(".ctl"):
            stale = name[: -len(".ctl")] not in present
        else:
            continue
        if stale:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(seg_dir, name))
                gone += 1
    return gone


def reachable(target: str) -> bool:
    """Whether ``shm://<token>`` is served on this host (its descriptor is in our /dev/shm:
    a store in another network namespace with its own /dev/shm is not)."""
    if not target.startswith("shm://"):
        return False
    return os.path.exists(_descriptor_path(target[len("shm://") :]))


def map_segment(name: str, size: int) -> mmap.mmap:
    """Map shared-memory segment ``name`` (at least ``size`` bytes) without registering it
    with this process's resource tracker (which would unlink it at exit)."""
    import _posixshmem

    try:
        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise TransportError("unreachable", f"no shared-memory segment {name!r}") from None
    try:
        if os.fstat(fd).st_size < size:
            raise TransportError("refused", f"segment {name!r} is smaller than {size} bytes")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    # Not populated here: its owner maps its pages (services.common.prefault), and this
    # mapping takes a minor fault per page on first touch; a madvise over the whole
    # segment would hold this process's GIL (its event loop) 0.5 s per 2 GB, at the
    # first ship to a store just restarted.
    return mm


def copy(dst: memoryview, src: memoryview) -> None:
    """memcpy; numpy releases the GIL for it."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class ShmReceiver(Receiver):
    """Exposes registered memory to same-host peers through shared memory."""

    scheme = "shm"

    def __init__(self, token: str | None = None) -> None:
        self.token = token or f"{os.getpid()}-{secrets.token_hex(4)}"
        self._regions: dict[int, Region] = {}
        self._closed = False
        self._publish()

    @property
    def address(self) -> str:
        return f"shm://{self.token}"

    def expose(self, region: Region) -> None:
        if not region.name:
            raise TransportError("bad_request", f"region {region.id} is not shared memory")
        self._regions[region.id] = region
        self._publish()

    def withdraw(self, region_id: int) -> None:
        self._regions.pop(region_id, None)
        self._publish()

    def _publish(self) -> None:
        desc = {
            str(r.id): {"name": r.name, "offset": int(r.extra.get("offset", 0)), "size": len(r.buf)}
            for r in self._regions.values()
        }
        path = _descriptor_path(self.token)
        tmp = f"{path}.{secrets.token_hex(3)}.tmp"
        with open(tmp, "w") as f:
            json.dump(desc, f)
        os.replace(tmp, path)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            os.unlink(_descriptor_path(self.token))
        except FileNotFoundError:
            pass


class _Mapping:
    """A target's regions, mapped into this process."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.views: dict[int, memoryview] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self.load()

    def load(self) -> None:
        try:
            with open(_descriptor_path(self.token)) as f:
                desc = json.load(f)
        except FileNotFoundError:
            raise TransportError(
                "unreachable", f"no shm target {self.token!r} on this host"
            ) from None
        except (OSError, ValueError) as e:
            raise TransportError("unreachable", f"shm target {self.token!r}: {e}") from None
        for rid, d in desc.items():
            if int(rid) in self.views:
                continue
            mm = self._maps.get(d["name"])
            end = int(d["offset"]) + int(d["size"])
            if mm is None or len(mm) < end:
                mm = self._maps[d["name"]] = map_segment(d["name"], end)
            self.views[int(rid)] = memoryview(mm)[int(d["offset"]) : end]

    def region(self, rid: int) -> memoryview:
        v = self.views.get(rid)
        if v is None:
            self.load()
            v = self.views.get(rid)
        if v is None:
            raise TransportError("refused", f"shm target {self.token!r} has no region {rid}")
        return v

    def close(self) -> None:
        for v in self.views.values():
            v.release()
        self.views.clear()
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:
                pass
        self._maps.clear()


class _Parts:
    """The helpers' parts of one split copy: the copying thread waits for them."""

    def __init__(self, n: int) -> None:
        self._left = n
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.error: BaseException | None = None
        if n == 0:
            self._done.set()

    def one(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


class ShmSender(Sender):
    """Copies bytes to and from same-host peers' shared-memory regions."""

    scheme = "shm"

    def __init__(
        self,
        max_targets: int = 64,
        copy_threads: int = 1,
        inline_below: int = 1 << 62,
        split_min: int = 1 << 62,
        split_threads: int = 0,
    ) -> None:
        self.inline_below = inline_below
        self.split_min = split_min
        self._split_q: queue.SimpleQueue = queue.SimpleQueue()
        self._helpers = [
            threading.Thread(target=self._help, name=f"shm-split-{i}", daemon=True)
            for i in range(max(0, split_threads))
        ]
        for h in self._helpers:
            h.start()
        self._lock = threading.Lock()
        self._pool: SievePool[str, _Mapping] = SievePool(max_targets)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"shm-copy-{i}", daemon=True)
            for i in range(max(1, copy_threads))
        ]
        for t in self._threads:
            t.start()

    def submit(self, req: Request) -> Ticket:
        t = Ticket(req.length)
        if self._closed:
            t.fail(TransportError("closed", "sender is closed"))
            return t
        if req.length < self.inline_below:
            self._copy(req, t)  # a thread hop costs more than a small memcpy
        else:
            self._q.put((req, t))
        return t

    def _mapping(self, target: str) -> _Mapping:
        if not target.startswith("shm://"):
            raise TransportError("bad_request", f"not a shm target: {target!r}")
        token = target[len("shm://") :]
        with self._lock:
            m = self._pool.get(token)
            if m is None:
                m = _Mapping(token)
                for _, old in self._pool.put(token, m):
                    old.close()
            return m

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            self._copy(*item)

    def _copy(self, req: Request, t: Ticket) -> None:
        try:
            t.started()
            remote = self._mapping(req.target).region(req.region)
            n = req.length
            if req.offset < 0 or req.offset + n > len(remote):
                raise TransportError(
                    "refused",
                    f"span {req.offset}+{n} outside region {req.region} of {len(remote)} bytes",
                )
            span = remote[req.offset : req.offset + n]
            src, dst = (req.local, span) if req.opcode == Opcode.WRITE else (span, req.local)
            if n >= self.split_min and self._helpers:
                self._split_copy(dst, src)
            else:
                copy(dst, src)
            if req.checksum and crc32(src) != crc32(dst):
                raise TransportError(
                    "checksum",
                    f"copy to {req.target} region {req.region} does not match its source",
                )
            t.slice_done(n)
        except TransportError as e:
            t.fail(e)
        except Exception as e:  # noqa: BLE001 - a bad request must not kill the copy thread
            t.fail(TransportError("internal", f"{type(e).__name__}: {e}"))

    def _split_copy(self, dst: memoryview, src: memoryview) -> None:
        n = len(dst)
        step = -(-n // (len(self._helpers) + 1))
        step += -step % 4096  # whole pages per part
        parts = _Parts(len(range(step, n, step)))
        for lo in range(step, n, step):
            self._split_q.put((dst[lo : lo + step], src[lo : lo + step], parts))
        try:
            copy(dst[:step], src[:step])
        finally:
            parts.wait()  # the helpers' copies end before the caller hears of this one

    def _help(self) -> None:
        while True:
            item = self._split_q.get()
            if item is None:
                return
            dst, src, parts = item
            try:
                copy(dst, src)
            except BaseException as e:  # noqa: BLE001 - handed to the copying thread
                parts.one(e)
            else:
                parts.one()

    def close(self) -> None:
        self._closed = True
        for _ in self._threads:
            self._q.put(None)
        for _ in self._helpers:
            self._split_q.put(None)
        with self._lock:
            for k in list(self._pool):
                m = self._pool.remove(k)
                if m is not None:
                    m.close()
