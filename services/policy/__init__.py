"""Pure decisions that several services and the simulator share (no I/O, no clock of
their own): chunked pipeline timing (:mod:`.chunk_timing`: the conductor's placement,
the prefill pipeline, the simulator) and the decode instance's TBT check
(:mod:`.decode_side_check`: the decode worker, the simulator)."""
