"""One node's store process: the NATS service (:mod:`.server`), what it hands its
collaborators (:mod:`.store_core`), the data plane (:mod:`.data_plane`, with the slot
fence and shared slot generations), objects (:mod:`.object_service` and the TCP
endpoint :mod:`.object_server`), copies between stores (:mod:`.replication`) and the
tiers' byte stores and moves (:mod:`.tier_stores`, :mod:`.tiering`)."""
