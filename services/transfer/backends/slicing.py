"""Cut a request into slices and spread them over paths (pure).

Mooncake slices every request (16 KiB for RDMA) so that all NICs work on one big
transfer together. Over TCP each slice costs a header and a Python hop, so slices
are bigger: a transfer is split evenly over the paths, at least ``min_bytes`` and at
most ``max_bytes`` a slice, and slices are dealt round robin starting at ``start``.
A transfer above ``paths * max_bytes`` gives each path the same number of equal
slices: capping the slice alone left a short extra slice on one path, which then
carried more than the others and ended last (16.9 MiB over 4 paths of 4 MiB slices:
4.9 MiB on one path instead of 4.2).
"""

from dataclasses import dataclass

MIN_SLICE = 512 * 1024  # below this a slice costs more in hand-offs than parallel streams win
MAX_SLICE = 4 << 20


@dataclass(frozen=True)
class Slice:
    """One slice of a request: where it starts, how long, on which path."""

    offset: int  # from the start of the request
    length: int
    path: int


def plan(
    length: int, paths: int, start: int = 0, min_bytes: int = MIN_SLICE, max_bytes: int = MAX_SLICE
) -> list[Slice]:
    if length < 0 or paths <= 0:
        raise ValueError("length must be >= 0 and paths positive")
    if length == 0:
        return [Slice(0, 0, start % paths)]
    size = -(-length // paths)
    if size > max_bytes:
        rounds = -(-size // max_bytes)  # slices per path
        size = -(-length // (paths * rounds))
    size = max(min_bytes, size)
    out = []
    for k, off in enumerate(range(0, length, size)):
        out.append(Slice(off, min(size, length - off), (start + k) % paths))
    return out
