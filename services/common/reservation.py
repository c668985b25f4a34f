"""The arithmetic of a placed request's store reservation, written once: the live
prefill instance (``services.prefill.reserve`` and ``queue``) and the simulator
(``perigee.sim``) both call it. Pure: no I/O, no clock.

When a request's compute starts its prefill instance opens, in one round::

    PREFILL  on its own node       the whole prompt (the node's hit comes back)
    DECODE   on the decode node    the whole prompt
    SOURCE   on the prefix holder  blocks [0, first_block + num_blocks): the whole
                                   prefix, as where the pull starts is known only once
                                   the prefill node has answered with its own hit

(:func:`allocations` gives the messages; the conductor sends the first round itself
when it places a request on an idle instance, the replies going to the instance:
``services.prefill.reserve_ahead``), and reads each round's refusals with
:func:`next_step`: a SOURCE that breaks is dropped
(the prefix is computed locally), room refused is waited for, anything else fails the
request. From the grants, :func:`grant` says what is on the node before compute and
what is pulled.
"""

from dataclasses import dataclass
from enum import Enum

from bus_schemas.control import TxAllocate, TxRole
from bus_schemas.placement import PrefillTask, PrefixSource

PREFILL, DECODE, SOURCE = "prefill", "decode", "source"
WAIT_S = 60.0  # how long a reservation waits for room before the request fails
RETRY_S = 0.05  # how often a store short of room is asked again meanwhile
CAPACITY = "capacity"  # a store's refusal: every slot is held by running work


class BadPrefix(ValueError):
    """A placement whose remote prefix does not continue the local one."""


def expected_prefix_blocks(expected_hit: int, source: PrefixSource | None) -> int:
    """Leading blocks the conductor expects on the prefill node before compute: the local
    hit, extended by the remote blocks to pull (the reservation has the last word)."""
    if source is None or source.num_blocks <= 0:
        return expected_hit
    if source.first_block > expected_hit:
        raise BadPrefix(
            f"remote prefix starts at block {source.first_block} "
            f"but only {expected_hit} blocks are local"
        )
    return max(expected_hit, source.first_block + source.num_blocks)


def prefix_tokens(num_tokens: int, prefix_blocks: int, block_size: int) -> int:
    """Prompt tokens covered by ``prefix_blocks`` leading blocks."""
    return min(num_tokens, prefix_blocks * block_size)


def prefix_after(hit: int, pull: tuple[int, int] | None) -> int:
    """Leading blocks on the prefill node once ``pull`` (first_block, num_blocks) is in."""
    return max(hit, pull[0] + pull[1] if pull else 0)


@dataclass(frozen=True)
class Job:
    """One TxAllocate to send: ``role`` on ``node`` for these blocks and tokens."""

    node: str
    role: TxRole
    block_hashes: list[int]
    num_tokens: int


def jobs(
    *,
    prefill_node: str,
    decode_node: str,
    source: PrefixSource | None,
    block_hashes: list[int],
    num_tokens: int,
    block_size: int,
    roles: set[str],
) -> dict[str, Job]:
    """The TxAllocates of one round, for the ``roles`` still wanted."""
    out: dict[str, Job] = {}
    if PREFILL in roles:
        out[PREFILL] = Job(prefill_node, TxRole.PREFILL, block_hashes, num_tokens)
    if DECODE in roles:
        out[DECODE] = Job(decode_node, TxRole.DECODE, block_hashes, num_tokens)
    if SOURCE in roles and source is not None:
        end = source.first_block + source.num_blocks
        out[SOURCE] = Job(
            source.node, TxRole.SOURCE, block_hashes[:end], min(num_tokens, end * block_size)
        )
    return out


def allocations(
    task: PrefillTask, roles: set[str], lease_s: float
) -> dict[str, tuple[str, TxAllocate]]:
    """The TxAllocate of each role in ``roles`` for ``task``, by role: (node, message)."""
    req = task.request
    todo = jobs(
        prefill_node=task.prefill_node,
        decode_node=task.decode_node,
        source=task.source,
        block_hashes=req.block_hashes or [],
        num_tokens=len(req.prompt_token_ids),
        block_size=req.block_size,
        roles=roles,
    )
    return {
        role: (
            j.node,
            TxAllocate(
                request_id=req.request_id,
                role=j.role,
                block_hashes=j.block_hashes,
                num_tokens=j.num_tokens,
                retention=req.retention,
                context_ttl_s=req.context_ttl_s,
                lease_s=lease_s,
            ),
        )
        for role, j in todo.items()
    }


def wanted(source: PrefixSource | None) -> set[str]:
    """The roles a placement reserves."""
    return {PREFILL, DECODE} | ({SOURCE} if source is not None else set())


class ReservationStep(Enum):
    """What a reservation round leads to: done, wait for room, or fail."""

    DONE = "done"  # everything wanted is granted
    WAIT = "wait"  # a store is short of room: ask again later, keeping the grants
    FAIL = "fail"  # a store did not answer or refused otherwise


@dataclass(frozen=True)
class ReservationVerdict:
    """A reservation round's outcome: the next step and whether to drop the remote prefix."""

    step: ReservationStep
    drop_source: bool  # the holder refused or is gone: compute its prefix here
    detail: str = ""  # what refused, for the error or the log


def next_step(refused: dict[str, str], failed: dict[str, str]) -> ReservationVerdict:
    """What one round's refusals (role -> reason) and failures (role -> error) mean."""
    drop = SOURCE in refused or SOURCE in failed
    refused = {k: v for k, v in refused.items() if k != SOURCE}
    failed = {k: v for k, v in failed.items() if k != SOURCE}
    detail = "; ".join(f"{k}: {v}" for k, v in {**refused, **failed}.items())
    if failed or any(r != CAPACITY for r in refused.values()):
        return ReservationVerdict(ReservationStep.FAIL, drop, detail)
    if refused:
        return ReservationVerdict(ReservationStep.WAIT, drop, ", ".join(sorted(refused)))
    return ReservationVerdict(ReservationStep.DONE, drop)


@dataclass(frozen=True)
class ReservationGrant:
    """What the granted transactions mean for the compute."""

    prefix_blocks: int  # leading blocks on the prefill node before compute
    pull: tuple[int, int] | None  # (first_block, num_blocks) to pull under SOURCE
    ship_from_block: int  # the decode node already holds the blocks before this one

    @property
    def keep_source(self) -> bool:
        """False: the SOURCE transaction (if any) is not needed and is aborted."""
        return self.pull is not None

    def prefix_tokens(self, num_tokens: int, block_size: int) -> int:
        return prefix_tokens(num_tokens, self.prefix_blocks, block_size)

    def pulled_tokens(self, num_tokens: int, block_size: int) -> int:
        if self.pull is None:
            return 0
        first, count = self.pull
        return prefix_tokens(num_tokens, first + count, block_size) - prefix_tokens(
            num_tokens, first, block_size
        )

    def ship_tokens(self, num_tokens: int, block_size: int) -> int:
        return num_tokens - prefix_tokens(num_tokens, self.ship_from_block, block_size)


def source_plan(source: PrefixSource | None, hit: int) -> tuple[int, int] | None:
    """(first_block, num_blocks) to pull, given the prefill node's real hit: the pull
    starts where the local prefix ends; None when the node already has it all."""
    if source is None:
        return None
    end = source.first_block + source.num_blocks
    return (hit, end - hit) if hit < end else None


def grant(
    source: PrefixSource | None, *, prefill_hit: int, decode_hit: int = 0, source_granted: bool
) -> ReservationGrant:
    """From the grants: the prefill node's hit (``prefill_hit`` blocks), the decode
    node's, and whether the SOURCE transaction was granted."""
    pull = source_plan(source, prefill_hit) if source_granted else None
    return ReservationGrant(
        prefix_blocks=prefix_after(prefill_hit, pull), pull=pull, ship_from_block=decode_hit
    )
