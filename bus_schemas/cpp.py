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
    request_id: str
    stage: int
    stages: int
    num_tokens: int  # prompt tokens
    prefix_tokens: int  # the cached prefix: the chunks cover [prefix, n)
    chunk_tokens: int
    timeout_s: float  # a stage waits this long for a chunk or a free slot


class StageOpened(Msg):
    request_id: str
    stage: int
    segment: str = ""  # the inbox (stage > 0): its TransferEngine segment and region
    region: int = 0
    address: str = ""  # and where chunk notes go (ZeroMQ)


class StageRun(Msg):
    request_id: str
    next_stage: StageOpened | None = None  # None: the last stage


class StageDone(Msg):
    request_id: str
    stage: int
    chunks: int
    compute_s: float  # cost-model seconds the stage spent
