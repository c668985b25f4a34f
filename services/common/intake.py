"""What admission and the conductor both do with a request off the bus, written once:
where its events go, what can be saved from a payload that does not decode, and the
prompt's block hashes."""

import json
from collections.abc import Sequence

from services.common.hashing import block_hashes


def reply_to(body_reply: str, msg_reply: str | None) -> str:
    """Where a request's events go: its own ``reply_subject`` (it travels with the
    request when admission forwards it), else the NATS reply subject of the message."""
    return body_reply or msg_reply or ""


def salvage(data: bytes) -> tuple[str, str]:
    """(request_id, reply_subject) from a payload that failed strict decoding, if any."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return "", ""
    if not isinstance(obj, dict):
        return "", ""
    rid, reply = obj.get("request_id"), obj.get("reply_subject")
    return (rid if isinstance(rid, str) else ""), (reply if isinstance(reply, str) else "")


def hashes_for(
    tokens: Sequence[int], given: Sequence[int] | None, given_size: int, block_size: int
) -> list[int]:
    """The chained hashes of ``tokens``' full blocks of ``block_size``: ``given`` when the
    client hashed with that size (``given_size`` 0 means it did), else computed here.
    ValueError when given hashes do not match the prompt's full blocks in number."""
    if given is None or given_size not in (0, block_size):
        return block_hashes(tokens, block_size)
    full = len(tokens) // block_size
    if len(given) != full:
        raise ValueError(
            f"block_hashes has {len(given)} entries, the prompt has {full} full blocks "
            f"of {block_size}"
        )
    return list(given)
