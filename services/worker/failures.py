"""What a failed task tells the client, for both workers: :func:`classify` (and
:class:`~services.common.errors.BadTask`, which it knows). Each role adds its own rules (its store and transfer errors) ahead of
the ones every worker shares."""

from collections.abc import Callable, Sequence

from bus_schemas.requests import ErrorCode
from services.common.errors import BadTask
from services.engine import EngineDeadError, EngineError

# (exception types, code, client message from the exception)
Rule = tuple[
    type[BaseException] | tuple[type[BaseException], ...],
    ErrorCode,
    Callable[[BaseException], str],
]


def classify(exc: BaseException, role: str, rules: Sequence[Rule] = ()) -> tuple[ErrorCode, str]:
    """(code, short client message) for a failed ``role`` task: a bad task, then the
    role's ``rules`` in order, then the engine's failures; anything else is internal."""
    if isinstance(exc, BadTask):
        return ErrorCode.INTERNAL, f"bad {role} task: {exc}"
    for types, code, message in rules:
        if isinstance(exc, types):
            return code, message(exc)
    if isinstance(exc, EngineDeadError):
        return ErrorCode.UNAVAILABLE, f"{role} engine is down"
    if isinstance(exc, EngineError):
        return ErrorCode.INTERNAL, f"{role} failed: {exc}"
    return ErrorCode.INTERNAL, f"{role} failed: internal error"
