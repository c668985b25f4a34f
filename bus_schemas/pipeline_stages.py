"""perigee.prefill.<instance>.cpp: a pipeline's anchor drives its stages (chunked
pipeline parallelism, services.prefill.cpp_pipeline).

The anchor opens the stages last to first (:class:`StageOpen`; stage s > 0 answers
with its inbox, :class:`StageOpened`), then runs them all (:class:`StageRun`: stage s
writes its activations into stage s+1's inbox over the TransferEngine). A stage
answers :class:`StageDone` when its last chunk is through, or an error reply
(``Perigee-Error``, services.common.bus) with the stage's error code. Only
coordination crosses the bus: activations go over the transfer engine."""

from bus_schemas._base import Msg


class StageOpen(Msg):
    """Open one stage of a request's pipeline for its chunks."""

    request_id: str
    stage: int
    stages: int
    num_tokens: int  # prompt tokens
    prefix_tokens: int  # the cached prefix: the chunks cover [prefix, n)
    chunk_tokens: int
    timeout_s: float  # a stage waits this long for a chunk or a free slot


class StageOpened(Msg):
    """A stage's answer to StageOpen: the inbox the stage before it writes activations into."""

    request_id: str
    stage: int
    segment: str = ""  # the inbox (stage > 0): its TransferEngine segment and region
    region: int = 0
    address: str = ""  # and where chunk notes go (ZeroMQ)


class StageRun(Msg):
    """Run a stage's chunks, sending activations on to the next stage's inbox."""

    request_id: str
    next_stage: StageOpened | None = None  # None: the last stage


class StageDone(Msg):
    """A stage's answer once its last chunk is through, with the compute it spent."""

    request_id: str
    stage: int
    chunks: int
    compute_s: float  # cost-model seconds the stage spent
