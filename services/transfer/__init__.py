"""The transfer engine the stores and the prefill pipeline share: byte-moving backends
behind one Sender/Receiver contract (:mod:`.backends`: shared memory, multi-stream TCP,
RDMA), the paper's batch transfer API over them (:mod:`.batch_api`), the run's data key
and message MACs (:mod:`.data_auth`), and the data plane's coordination frames
(:mod:`.wire`) with their request/reply channels (:mod:`.channel` over ZeroMQ,
:mod:`.local_channel` over a Unix socket). It imports nothing of the store."""
