"""Every message that crosses the NATS bus, as frozen msgspec Structs.

One module per subject family; subject names live in :mod:`bus_schemas.subjects`.
Decoding is strict (``forbid_unknown_fields``): see :mod:`bus_schemas.codec`.
"""
