"""A perigee block's slot seen as vLLM's pages, and the store's arena page-locked for
CUDA copies (no vLLM import: the GPU tests and ``perigee bench ship --cuda`` use it
without an engine).

A slot holds one perigee block, every layer, layer-major: layer ``l``, vLLM sub-block
``s`` at byte ``(l * per_block + s) * page_bytes`` (see :mod:`.connector`). A page is
one vLLM block of one layer, ``kv[block_id]``, in the layout of whatever attention
backend allocated it, so the same bytes move on CPU and CUDA.

The connector moves a layer's pages in one batch (:mod:`.page_batch`, through torch's
own page-locked staging); what it copies one page at a time (decode write-back
staging, a slot that is not whole pages of its mapping) goes through ``Tensor.copy_``.
From pageable memory the CUDA driver stages each such copy through a bounce buffer of
its own; from memory registered with ``cudaHostRegister`` it moves the bytes by DMA
straight from the shared mapping. :class:`ArenaPinner` registers each mapping the slots come from once, the
first time a slot of it is copied to or from a CUDA page.
"""

import ctypes
import mmap
from typing import Any

import structlog
import torch

log = structlog.get_logger()


def page_view(
    raw: torch.Tensor, layer: int, sub: int, per_block: int, page_bytes: int, like: torch.Tensor
) -> torch.Tensor:
    """Layer ``layer``, sub-block ``sub`` of a slot's bytes ``raw``, shaped as ``like``."""
    off = (layer * per_block + sub) * page_bytes
    return raw[off : off + page_bytes].view(like.dtype).view(like.shape)


def _address(buf: Any) -> tuple[int, int]:
    """(address, length) of a writable buffer; the export is released before returning."""
    c = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(c), len(buf)
    finally:
        del c


def _ok(rc: Any) -> bool:
    return int(getattr(rc, "value", rc)) == 0


def host_register(buf: Any) -> int | None:
    """Page-lock ``buf`` for CUDA (cudaHostRegister); its address, or None (and why, in
    the log) where CUDA is absent or the driver refuses."""
    if not torch.cuda.is_available():
        return None
    try:
        addr, size = _address(buf)
        rc = torch.cuda.cudart().cudaHostRegister(addr, size, 0)
    except (RuntimeError, TypeError, ValueError, AttributeError) as e:
        log.warning("arena_pin_failed", error=f"{type(e).__name__}: {e}")
        return None
    if not _ok(rc):
        log.warning("arena_pin_failed", error=str(rc), bytes=size)
        return None
    return addr


def host_unregister(addr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(addr)
    except (RuntimeError, TypeError, AttributeError) as e:
        log.warning("arena_unpin_failed", error=f"{type(e).__name__}: {e}")


class ArenaPinner:
    """Page-locks the shared-memory mappings that slot views come from, each once.

    A slot is a ``memoryview`` slice of the arena's mapping (``view.obj``). Registering
    the whole mapping once costs a few ms per GB; registering per copy would cost more
    than the copy. A mapping the store replaces (a restarted store: a new arena) is a
    new object and is registered when first seen; the old one stays registered until
    :meth:`close` (its pages are the store's to free once the worker unmaps them)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and torch.cuda.is_available()
        self._pinned: dict[int, tuple[Any, int | None]] = {}  # id(mapping) -> (it, address)

    def pin(self, view: memoryview) -> bool:
        """Register the mapping under ``view``; whether it is page-locked."""
        if not self.enabled:
            return False
        base = view.obj if isinstance(view, memoryview) else view
        if not isinstance(base, mmap.mmap | bytearray):
            base = view
        got = self._pinned.get(id(base))
        if got is not None and got[0] is base:
            return got[1] is not None
        addr = host_register(base)
        self._pinned[id(base)] = (base, addr)
        if addr is not None:
            log.info("arena_pinned", bytes=len(base))
        return addr is not None

    @property
    def pinned_bytes(self) -> int:
        return sum(len(b) for b, a in self._pinned.values() if a is not None)

    def close(self) -> None:
        for _, addr in self._pinned.values():
            if addr is not None:
                host_unregister(addr)
        self._pinned.clear()
