"""What keeps two stacks on one machine apart, and what a run leaves for its user.

- :class:`RunLock`: a run holds ``<log-dir>/perigee.lock`` (an ``flock``) from before it
  writes anything there until it has stopped, so a second run given the same
  ``--log-dir`` refuses before it touches the first one's ``credentials.json``,
  ``metrics-targets.json`` or service logs. The kernel drops the lock when its holder
  dies, even by SIGKILL: a stale file never blocks a later run.
- :func:`check_port`: the gateway's port is tried before anything starts, so a busy
  ``--port`` is refused at once, by name, instead of after the stack's start-up.
- :func:`write_env`: ``<log-dir>/env``, shell-sourceable, with the running stack's
  gateway URL and the bus URL with the admin login (README "Talking to the bus").
"""

import errno
import fcntl
import json
import os
import shlex
import socket
import time
from pathlib import Path

LOCK_NAME = "perigee.lock"
ENV_NAME = "env"


class RunCollision(RuntimeError):
    """The run would collide with another one (its port or its log directory)."""


class RunLock:
    """An exclusive lock on a log directory, held by this process until :meth:`release`."""

    def __init__(self, log_dir: str | Path) -> None:
        self.path = Path(log_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self, url: str = "") -> "RunLock":
        """Take the lock or raise :class:`RunCollision` naming the run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunCollision(
                f"another perigee run{self._holder()} is using the log directory "
                f"{self.path.parent}: stop it, or give this one another --log-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "url": url, "since": time.time()}).encode())
        self._fd = fd
        return self

    def _holder(self) -> str:
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return ""
        parts = [f"pid {info['pid']}" if info.get("pid") else "", info.get("url") or ""]
        return f" ({', '.join(p for p in parts if p)})" if any(parts) else ""

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def port_in_use(host: str, port: int) -> bool:
    """True when something listens on ``host:port`` (SO_REUSEADDR, as the gateway's own
    listener sets it: a port in TIME_WAIT is not busy). An address this host does not
    have is not "in use" here: the gateway reports that itself."""
    if port == 0:
        return False
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def check_port(host: str, port: int, flag: str = "--port") -> None:
    if port_in_use(host, port):
        raise RunCollision(
            f"port {port} on {host} is already in use (another perigee up, or another "
            f"server): give this one another port with {flag} N"
        )


def env_text(values: dict[str, str], comment: str = "") -> str:
    lines = [f"# {line}" for line in comment.splitlines()]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def write_env(log_dir: str | Path, values: dict[str, str], comment: str = "") -> Path:
    """Write ``<log_dir>/env`` (mode 0600: it holds the bus's admin password)."""
    path = Path(log_dir) / ENV_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(env_text(values, comment))
    return path


def read_env(path: str | Path) -> dict[str, str]:
    """The variables of an env file written by :func:`write_env`."""
    out: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            out[key] = shlex.split(value)[0] if value else ""
    return out
