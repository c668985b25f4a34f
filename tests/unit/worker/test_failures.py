"""Both workers' failed tasks map to the codes and client messages they always had, now
from one classifier (services.worker.failures) and each role's own rules."""

import nats.errors
import pytest

from bus_schemas.requests import ErrorCode
from services.common.bus import RemoteError
from services.common.errors import BadTask
from services.common.store_tx import LeaseExpired
from services.decode.worker import classify as decode_classify
from services.engine import EngineDeadError, EngineError
from services.engine.base import EngineRequestError
from services.prefill.cpp_pipeline import PipelineError
from services.prefill.reserve import ReserveError
from services.prefill.worker import KV_RESERVATION_FAILED, KV_TRANSFER_FAILED
from services.prefill.worker import classify as prefill_classify
from services.store.client.store_client import TransferError

U, INT, B = ErrorCode.UNAVAILABLE, ErrorCode.INTERNAL, ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (BadTask("empty prompt"), (INT, "bad prefill task: empty prompt")),
        (LeaseExpired("gone"), (U, f"{KV_RESERVATION_FAILED}: gone")),
        (EngineDeadError("x"), (U, "prefill engine is down")),
        (EngineRequestError("too long"), (B, "the engine refused the request: too long")),
        (EngineError("oops"), (INT, "prefill failed: oops")),
        (ReserveError("capacity", "full"), (U, f"{KV_RESERVATION_FAILED}: full")),
        (TimeoutError("slow"), (U, f"{KV_TRANSFER_FAILED}: slow")),
        (ConnectionError("reset"), (U, f"{KV_TRANSFER_FAILED}: reset")),
        (KeyError("k"), (INT, "prefill failed: internal error")),
    ],
)
def test_prefill(exc, expected):
    assert prefill_classify(exc) == expected


def test_prefill_pipeline_and_transfer():
    code, msg = prefill_classify(PipelineError(ErrorCode.UNAVAILABLE, "stage 1 died"))
    assert code == U and msg == "cpp pipeline failed: stage 1 died"
    code, msg = prefill_classify(TransferError(ErrorCode.UNAVAILABLE, "refused"))
    assert code == U and msg.startswith(f"{KV_TRANSFER_FAILED}: ")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (BadTask("empty prompt"), (INT, "bad decode task: empty prompt")),
        (LeaseExpired("lease gone"), (U, "lease gone")),
        (EngineDeadError("x"), (U, "decode engine is down")),
        (EngineRequestError("no"), (INT, "decode failed: no")),
        (EngineError("oops"), (INT, "decode failed: oops")),
        (TimeoutError(), (U, "decode store unavailable")),
        (nats.errors.NoRespondersError(), (U, "decode store unavailable")),
        (KeyError("k"), (INT, "decode failed: internal error")),
    ],
)
def test_decode(exc, expected):
    assert decode_classify(exc) == expected


def test_decode_remote_error():
    assert decode_classify(RemoteError(ErrorCode.UNAVAILABLE, "store down")) == (
        U,
        "decode store unavailable",
    )
