import msgspec


class Msg(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every bus message: immutable, keyword-only, strict on decode."""
