"""Deployment templates ship placeholder secrets (``REPLACE-ME-...`` in
``deploy/k8s/base/credentials.env``). A service given one refuses to start, with a
message naming it, instead of serving a bus or an API guarded by a published value."""

PLACEHOLDER = "REPLACE-ME"


class PlaceholderSecret(SystemExit):
    """Exit status 1, the message on stderr, no traceback."""


def refuse_placeholder(what: str, value: str | None, where: str = "") -> None:
    """Raise :class:`PlaceholderSecret` when ``value`` is a template's placeholder."""
    if value and PLACEHOLDER.lower() in value.lower():
        hint = f" (set in {where})" if where else ""
        raise PlaceholderSecret(
            f"refusing to start: {what} is still the placeholder {value!r}{hint}; "
            "replace every REPLACE-ME value with a secret of your own "
            "(deploy/k8s/base/credentials.env: README, Deploy on Kubernetes)"
        )
