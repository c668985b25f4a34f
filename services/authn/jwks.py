"""Where the cluster's ServiceAccount signing keys come from: a file (tests, clusters
whose keys an operator exports) or the API server's ``/openid/v1/jwks``, read with this
pod's own token and the cluster CA. A refetch is rate-limited, so a stream of tokens
naming unknown key ids cannot make the callout hammer the API server."""

import json
import ssl
import urllib.request
from collections.abc import Callable
from typing import Any

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
IN_CLUSTER = "https://kubernetes.default.svc/openid/v1/jwks"
MIN_REFETCH_S = 30.0
_MAX_BYTES = 1 << 20


def _keys(doc: Any) -> dict[str, Any]:
    return doc if isinstance(doc, dict) else {"keys": []}


def read_file(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return _keys(json.load(f))


def read_url(url: str, *, sa_dir: str = SA_DIR, timeout: float = 5.0) -> dict[str, Any]:
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    ctx = ssl.create_default_context()
    try:
        with open(f"{sa_dir}/token", encoding="utf-8") as f:
            req.add_header("Authorization", f"Bearer {f.read().strip()}")
        ctx.load_verify_locations(f"{sa_dir}/ca.crt")
    except FileNotFoundError:
        pass  # outside a pod: the system's CAs, no bearer
    with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:  # noqa: S310 - https, operator's URL
        return _keys(json.loads(r.read(_MAX_BYTES)))


def source(file: str, url: str, clock: Callable[[], float]) -> Callable[[], dict[str, Any]]:
    """A reader of the keys that answers the last keys again within ``MIN_REFETCH_S``."""
    at = [float("-inf")]
    keys: list[dict[str, Any]] = [{"keys": []}]

    def read() -> dict[str, Any]:
        now = clock()
        if now - at[0] >= MIN_REFETCH_S:
            at[0] = now
            keys[0] = read_file(file) if file else read_url(url)
        return keys[0]

    return read
