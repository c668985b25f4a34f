"""The wording of a worker's errors that migrate a request, written once: the worker composes its
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


INSTANCE_RESTARTED = "instance restarted"


def restarted_message(instance: str) -> str:
    """A task addressed to an incarnation of ``instance`` that is gone."""
    return f"{INSTANCE_RESTARTED}: {instance} is a new incarnation since the request was placed"


def restarted_instance(message: str) -> str:
    """The instance a :func:`restarted_message` names."""
    return message.removeprefix(f"{INSTANCE_RESTARTED}: ").split(" ", 1)[0]


def instance_restarted(code: int, message: str) -> bool:
    """Whether a worker's error says the instance placed on restarted before the task
    reached it: the request goes on elsewhere, as after the old process's death."""
    return code == ErrorCode.UNAVAILABLE and message.startswith(INSTANCE_RESTARTED)
