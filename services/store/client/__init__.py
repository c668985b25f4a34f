"""The store's clients: a worker's handle on its node's store (:mod:`.store_client`) and
the object API over the stores (:mod:`.object_client`)."""
