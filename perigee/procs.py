"""Child processes that never outlive the process that started them.

``PR_SET_PDEATHSIG`` has the kernel send the child SIGTERM when its parent dies, by
SIGKILL too; each service exits on SIGTERM within its bound
(:mod:`services.common.shutdown`). Two limits of the kernel feature, and what covers
them: the signal goes when the *thread* that forked the child ends, so start children
from a thread that lives as long as they should (``perigee up``: the main thread); and
a parent that dies between ``fork`` and ``prctl`` sends nothing, so the child checks
that its parent is still the one that forked it.

Grandchildren are their parent's business: the services start none (vLLM runs
in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

import ctypes
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not glibc Linux: children may outlive a killed parent
    _libc = None


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child gets ``sig`` when the
    calling thread's process dies."""
    parent = os.getpid()

    def preexec() -> None:
        if _libc is None:
            return
        _libc.prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec
