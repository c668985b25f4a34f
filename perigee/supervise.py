"""Restart a service that dies, as systemd (``Restart=on-failure``, ``StartLimitBurst``)
or a Kubernetes kubelet (CrashLoopBackOff) would, and give up on one that keeps dying.

    RUNNING --exit--> BACKING_OFF (delay doubles with each recent restart, capped)
    BACKING_OFF --delay over--> RUNNING (the same command line, the same log file)
    any exit with ``max_restarts`` restarts already inside ``window_s`` --> GAVE_UP
                  (it stays down, the rest of the stack keeps serving, and it is said)

:class:`RestartPolicy` is the decision, pure (time is passed in); :class:`Supervisor`
is the thread that watches the children and acts on it. The thread also forks the
restarted children: their ``PR_SET_PDEATHSIG`` (:mod:`perigee.procs`) follows the
thread that forked them, so it lives until the stack has stopped them.
"""

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    """How often a dying service is restarted, and after how many deaths it is given up."""

    max_restarts: int = 5  # within window_s; one more exit and the service is given up
    window_s: float = 60.0
    backoff_s: float = 0.5  # before the first restart; doubles for each recent one
    max_backoff_s: float = 10.0

    def delay(self, recent_restarts: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * (2**recent_restarts))


@dataclass
class RestartBook:
    """Each service's recent restarts, and what to do when it exits."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    _restarts: dict[str, deque[float]] = field(default_factory=dict)

    def recent(self, name: str, now: float) -> int:
        times = self._restarts.setdefault(name, deque())
        while times and times[0] <= now - self.policy.window_s:
            times.popleft()
        return len(times)

    def on_exit(self, name: str, now: float) -> float | None:
        """Seconds to wait before restarting ``name``; None: give it up."""
        n = self.recent(name, now)
        if n >= self.policy.max_restarts:
            return None
        return self.policy.delay(n)

    def restarted(self, name: str, now: float) -> None:
        self._restarts.setdefault(name, deque()).append(now)


@dataclass
class SupervisedEvent:
    """A supervised service exited, was restarted or was given up."""

    name: str
    kind: str  # "exited" | "restarted" | "gave_up"
    returncode: int | None
    restarts: int  # recent restarts (in the policy's window)
    delay_s: float = 0.0
    error: str = ""  # a restart that could not fork

    def describe(self, policy: RestartPolicy) -> str:
        if self.error:
            return f"{self.name} could not be restarted: {self.error}"
        if self.kind == "exited":
            return f"{self.name} exited with {self.returncode}; restarting in {self.delay_s:.1f} s"
        if self.kind == "restarted":
            return f"{self.name} restarted (restart {self.restarts} in {policy.window_s:g} s)"
        n = f"{self.restarts} restart" + ("" if self.restarts == 1 else "s")
        return (
            f"{self.name} exited with {self.returncode} after {n} in "
            f"{policy.window_s:g} s: gave up on it, it stays down (the rest keep serving)"
        )


class Supervisor:
    """Watches ``procs()`` (name -> Popen) every ``interval`` s; an exited child is
    respawned by ``respawn(name)`` after its back-off, or given up."""

    def __init__(
        self,
        procs: Callable[[], dict],
        respawn: Callable[[str], None],
        policy: RestartPolicy | None = None,
        on_event: Callable[[SupervisedEvent], None] = lambda e: None,
        clock: Callable[[], float] = time.monotonic,
        interval: float = 0.2,
    ) -> None:
        self.book = RestartBook(policy or RestartPolicy())
        self.procs, self.respawn, self.on_event = procs, respawn, on_event
        self.clock, self.interval = clock, interval
        self.given_up: set[str] = set()
        self.restarts: dict[str, int] = {}  # all-time, per service
        self._due: dict[str, float] = {}  # name -> when to restart it
        self._lock = threading.Lock()  # held while forking, so hold() waits for a fork
        self._held = False
        self._quit = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="perigee-supervisor", daemon=True)
        self._thread.start()

    def hold(self) -> None:
        """Restart nothing from now on (the stack is stopping). The thread stays: the
        children it forked die with it. Returns after any fork in progress."""
        with self._lock:
            self._held = True

    def quit(self) -> None:
        """End the thread, once the children it forked are stopped."""
        self.hold()
        self._quit.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._quit.wait(self.interval):
            self.step()

    def step(self) -> None:
        with self._lock:
            if self._held:
                return
            now = self.clock()
            for name, proc in self.procs().items():
                if name in self.given_up or proc is None or proc.poll() is None:
                    continue
                due = self._due.get(name)
                if due is None:
                    delay = self.book.on_exit(name, now)
                    n = self.book.recent(name, now)
                    if delay is None:
                        self.given_up.add(name)
                        self.on_event(SupervisedEvent(name, "gave_up", proc.returncode, n))
                        continue
                    self._due[name] = due = now + delay
                    self.on_event(SupervisedEvent(name, "exited", proc.returncode, n, delay))
                if now >= due:
                    del self._due[name]
                    self.book.restarted(name, now)  # a failed fork counts too: bounded
                    try:
                        self.respawn(name)
                    except Exception as e:  # noqa: BLE001 - the thread must keep watching
                        self.on_event(SupervisedEvent(name, "exited", None, 0, 0.0, repr(e)))
                        continue
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    self.on_event(
                        SupervisedEvent(name, "restarted", None, self.book.recent(name, now))
                    )
