"""The two roles a serving instance takes (paper §3: the prefill and decode pools)."""

from enum import StrEnum


class Role(StrEnum):
    """A worker's role in the disaggregated pipeline."""

    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def other(self) -> "Role":
        """The role a role switch moves an instance of this role to."""
        return Role.DECODE if self is Role.PREFILL else Role.PREFILL


ROLES: tuple[Role, ...] = tuple(Role)
