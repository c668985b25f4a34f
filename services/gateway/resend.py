"""What the gateway resends when a request's prefill or decode instance dies. Pure.

The gateway is the one place that knows which tokens the client already has (it
streamed them), so it drives migration, as Dynamo's frontend does. On a watchdog
verdict that an instance died, :func:`plan` decides:

    Finish   the client already has every token (max_tokens reached, or the last one
             was a stop/EOS token): the stream ends here, nothing is resent
    GiveUp   ``attempts`` already reached ``--migration-limit``: a clear error
    Resume   a new GenerateRequest: the original prompt followed by the generated
             tokens, ``max_tokens`` less those, under a fresh attempt id
             (``<rid>-m<attempt>``) so that late events or a cancel of the dead
             attempt never touch the new one; its Tokens are shifted by ``offset``

Why resend rather than move the decode batch entry: the prompt's full blocks are in
the stores already (the prefill node commits them at the handoff, the decode node
when its engine has them), so the conductor's cache-aware placement finds them in its
shadow index and the prefill instance loads or pulls them instead of computing them;
only the tokens generated so far (and the prompt's last, partial block, which no store
keeps) are recomputed, in one prefill pass. Checkpointing the generated tokens' KV to
a store as decode goes was the alternative: it would put a store write (and a
transaction per block) on every decode step of every request, to save a prefill of a
few hundred tokens on the rare request whose worker dies; recomputing them costs
about as much as the prefill of a short prompt (``perigee bench migration``).

Greedy output is unchanged by a migration (the engine sees the same token sequence);
seeded random sampling restarts its generator, so its tail may differ.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from bus_schemas.requests import GenerateRequest, Migration
from bus_schemas.roles import Role
from services.common.hashing import block_hashes

STORE = "store"  # the dead "role" of a request whose KV store failed under it
REASONS: dict[str, str] = {
    Role.DECODE: "decode_died",
    Role.PREFILL: "prefill_died",
    STORE: "store_died",
}


@dataclass(frozen=True, slots=True)
class Resume:
    """Migration's decision to resend: the new attempt and where its tokens start."""

    request: GenerateRequest  # the attempt to publish
    offset: int  # generated tokens the client has; the attempt's index 0 is this one


@dataclass(frozen=True, slots=True)
class Finish:
    """Migration's decision to end the stream: the client already has every token."""

    finish_reason: str  # "length" | "stop"


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Migration's decision to fail the request, with the client's message."""

    message: str


Decision = Resume | Finish | GiveUp


def attempt_id(request_id: str, attempt: int) -> str:
    """The request id of migration ``attempt`` (0: the client's own)."""
    return request_id if attempt == 0 else f"{request_id}-m{attempt}"


def plan(
    original: GenerateRequest,
    generated: Sequence[int],
    *,
    attempts: int,
    limit: int,
    dead_role: str,
    dead_instance: str,
    reply_subject: str,
    eos_token_ids: Sequence[int] = (),
    dead_incarnation: int = 0,
    failure: str = "",
    wedged: bool = False,
) -> Decision:
    """What to do for ``original`` (as the client sent it) whose ``dead_role`` instance
    died after the client got ``generated``; ``attempts`` migrations happened before;
    ``reply_subject`` maps the new attempt's id to its stream. ``failure``: what went
    wrong, for the client, when no instance died (a store failed under the request)."""
    s = original.sampling
    k = len(generated)
    if k >= s.max_tokens:
        return Finish("length")
    if k and (
        generated[-1] in s.stop_token_ids or (not s.ignore_eos and generated[-1] in eos_token_ids)
    ):
        return Finish("stop")
    if attempts >= limit:
        why = (
            "migration is off (--migration-limit 0)"
            if limit == 0
            else f"the request was migrated {attempts} time(s) already (--migration-limit {limit})"
        )
        what = failure or f"{dead_role} instance {dead_instance} stopped responding"
        return GiveUp(f"{what} and {why}; request aborted")
    attempt = attempts + 1
    prompt = [*original.prompt_token_ids, *generated]
    bs = original.block_size
    rid = attempt_id(original.request_id, attempt)
    req = msgspec.structs.replace(
        original,
        request_id=rid,
        prompt_token_ids=prompt,
        # The client has k tokens (and the prompt's logprobs when k > 0, which came with
        # the first); min_tokens counts them.
        sampling=msgspec.structs.replace(
            s,
            max_tokens=s.max_tokens - k,
            min_tokens=max(s.min_tokens - k, 0),
            prompt_logprobs=s.prompt_logprobs if k == 0 else None,
            # the grammar resumes over the tokens the prompt now holds past the original
            structured=s.structured
            if s.structured is None or s.structured.answer_start
            else msgspec.structs.replace(s.structured, answer_start=len(original.prompt_token_ids)),
        ),
        block_hashes=block_hashes(prompt, bs) if bs else None,
        reply_subject=reply_subject,
        migration=Migration(
            of_request_id=original.request_id,
            attempt=attempt,
            reason=REASONS.get(dead_role, f"{dead_role}_died"),
            dead_instance=dead_instance,
            resumed_tokens=k,
            prompt_tokens=len(original.prompt_token_ids),
            dead_request_id=attempt_id(original.request_id, attempts),
            dead_incarnation=dead_incarnation,
            wedged=wedged,
        ),
    )
    return Resume(req, k)
