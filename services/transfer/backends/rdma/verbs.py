"""Where the verbs come from: Debian's pyverbs (python3-pyverbs), or a stand-in for tests.

``load()`` returns a namespace with the pyverbs modules the backend uses (device, pd,
mr, cq, qp, wr, addr, enums) or raises ImportError with the reason. ``discover()``
lists RDMA devices; "no device" is an answer, not an error, so callers can skip the
backend with a clear reason.
"""

import types

from services.transfer.backends.contract import Availability

INSTALL_HINT = (
    "apt-get install -y python3-pyverbs, and make it importable in the venv "
    "(a .pth naming a folder that holds only a pyverbs symlink)"
)


def load() -> types.SimpleNamespace:
    try:
        import pyverbs.addr as addr
        import pyverbs.cq as cq
        import pyverbs.device as device
        import pyverbs.enums as enums
        import pyverbs.mr as mr
        import pyverbs.pd as pd
        import pyverbs.qp as qp
        import pyverbs.wr as wr
    except ImportError as e:
        raise ImportError(f"pyverbs is not importable ({e}); {INSTALL_HINT}") from None
    return types.SimpleNamespace(
        addr=addr, cq=cq, device=device, enums=enums, mr=mr, pd=pd, qp=qp, wr=wr
    )


def device_names(v: types.SimpleNamespace) -> list[str]:
    """Names of the RDMA devices ``v`` sees ([] when there are none)."""
    try:
        devs = v.device.get_device_list()
    except Exception:  # noqa: BLE001 - pyverbs raises PyverbsRDMAError when there are none
        return []
    out = []
    for d in devs:
        name = d.name
        out.append(name.decode() if isinstance(name, bytes) else str(name))
    return out


def discover(v: types.SimpleNamespace | None = None) -> tuple[Availability, list[str]]:
    if v is None:
        try:
            v = load()
        except ImportError as e:
            return Availability(False, str(e)), []
    names = device_names(v)
    if not names:
        return Availability(
            False,
            "no RDMA device found (ibv_get_device_list is empty: no "
            "NIC with RDMA, or no rdma-core provider for it)",
        ), []
    return Availability(True), names
