"""The wording of a prefill worker's KV errors, written once: the worker composes its
messages from it and the gateway reads them back to tell a store that failed under a
request (which migrates it) from one that refused for room (which does not)."""

from bus_schemas.requests import ErrorCode

KV_RESERVATION_FAILED = "kv reservation failed"
KV_TRANSFER_FAILED = "kv transfer failed"
STORE_UNAVAILABLE = "store unavailable"


def store_failure(code: int, message: str) -> bool:
    """Whether a worker's error says the request's KV store failed under it (died, or
    was cut off mid-transfer): the request can go on elsewhere, from the tokens its
    client has, as after a worker's death. A store that refused for room is not one."""
    if code != ErrorCode.UNAVAILABLE:
        return False
    return message.startswith(KV_TRANSFER_FAILED) or (
        message.startswith(KV_RESERVATION_FAILED) and STORE_UNAVAILABLE in message
    )
