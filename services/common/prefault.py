"""Map a shared-memory segment's pages ahead of use without holding the event loop.

``MADV_POPULATE_WRITE`` (Linux >= 5.14) maps every page of a range at once, sparing the
copies into it a page fault per 4 KiB. But CPython's ``mmap.madvise`` holds the GIL for
the whole call, even from another thread: populating SmolLM2's 2.1 GB store arena took
1.2 s on an idle core and 5-6 s beside two engines, and a restarted store answered
nothing meanwhile (as long, each worker that followed it to its new arena). So the
range goes in chunks, with a turn of the event loop between them.
"""

import asyncio
import mmap
from collections.abc import Iterator

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
CHUNK = 16 << 20  # bytes a call populates: 8-40 ms of the loop at a time


def chunks(mm: mmap.mmap, chunk: int = CHUNK) -> Iterator[int]:
    """Populate ``mm`` a chunk at a time, yielding the bytes done after each. Raises
    what ``madvise`` raises: ``OSError`` where the kernel lacks the advice, ``ValueError``
    once the map is closed."""
    size = len(mm)
    done = 0
    while done < size:
        n = min(chunk, size - done)
        mm.madvise(MADV_POPULATE_WRITE, done, n)
        done += n
        yield done


def supported(mm: mmap.mmap) -> bool:
    """Whether this kernel populates on advice (tried on the first page)."""
    try:
        mm.madvise(MADV_POPULATE_WRITE, 0, min(len(mm), mmap.PAGESIZE))
        return True
    except (OSError, ValueError, AttributeError):
        return False


def populate(mm: mmap.mmap) -> bool:
    """All of ``mm`` now, in one go (nothing is served yet); whether the kernel did."""
    try:
        mm.madvise(MADV_POPULATE_WRITE)
        return True
    except (OSError, ValueError, AttributeError):
        return False


async def populate_async(mm: mmap.mmap, chunk: int = CHUNK) -> bool:
    """All of ``mm``, a chunk per turn of the event loop; whether it got to the end (a
    map closed meanwhile, or a kernel without the advice, stops it: the pages then
    fault in on first touch, as they would have)."""
    try:
        for _ in chunks(mm, chunk):
            await asyncio.sleep(0)
        return True
    except (OSError, ValueError, AttributeError):
        return False
