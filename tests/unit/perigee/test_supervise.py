"""The restart policy and the supervisor's steps, hand-stepped on an injected clock with
fake processes (the real SIGKILL and restart: tests/e2e/test_supervise.py)."""

from perigee.supervise import RestartBook, RestartPolicy, Supervisor


class Proc:
    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_and_is_capped():
    p = RestartPolicy(backoff_s=0.5, max_backoff_s=3.0)
    assert [p.delay(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_gives_up_after_max_restarts_inside_the_window():
    book = RestartBook(RestartPolicy(max_restarts=2, window_s=10.0, backoff_s=1.0))
    assert book.on_exit("d", 0.0) == 1.0
    book.restarted("d", 1.0)
    assert book.on_exit("d", 2.0) == 2.0
    book.restarted("d", 4.0)
    assert book.on_exit("d", 5.0) is None
    # Restarts older than the window no longer count: the back-off starts again.
    assert book.on_exit("d", 14.5) == 1.0
    assert book.on_exit("other", 5.0) == 1.0


def _supervisor(policy: RestartPolicy):
    clock = Clock()
    procs = {"decode-0": Proc(), "gateway": Proc()}
    spawned: list[str] = []
    events = []

    def respawn(name: str) -> None:
        spawned.append(name)
        procs[name] = Proc()

    sup = Supervisor(lambda: procs, respawn, policy, on_event=events.append, clock=clock)
    return sup, clock, procs, spawned, events


def test_restarts_the_dead_one_after_its_backoff_and_leaves_the_rest():
    sup, clock, procs, spawned, events = _supervisor(RestartPolicy(backoff_s=0.5))
    sup.step()
    assert spawned == [] and events == []
    procs["decode-0"].returncode = -9
    sup.step()
    assert spawned == []
    assert [(e.name, e.kind, e.returncode, e.delay_s) for e in events] == [
        ("decode-0", "exited", -9, 0.5)
    ]
    clock.now += 0.4
    sup.step()
    assert spawned == []
    clock.now += 0.1
    sup.step()
    assert spawned == ["decode-0"]
    assert events[-1].kind == "restarted" and events[-1].restarts == 1
    assert sup.restarts == {"decode-0": 1}
    assert procs["decode-0"].poll() is None
    sup.step()
    assert spawned == ["decode-0"]


def test_a_crash_loop_is_given_up_and_said():
    sup, clock, procs, spawned, events = _supervisor(
        RestartPolicy(max_restarts=3, window_s=60.0, backoff_s=1.0, max_backoff_s=100.0)
    )
    for _ in range(3):
        procs["decode-0"].returncode = 1
        sup.step()
        clock.now += events[-1].delay_s
        sup.step()
    assert spawned == ["decode-0"] * 3
    assert [e.delay_s for e in events if e.kind == "exited"] == [1.0, 2.0, 4.0]
    procs["decode-0"].returncode = 1
    sup.step()
    clock.now += 1000.0
    sup.step()
    assert spawned == ["decode-0"] * 3  # given up: it stays down
    assert sup.given_up == {"decode-0"}
    gave_up = [e for e in events if e.kind == "gave_up"]
    assert len(gave_up) == 1
    text = gave_up[0].describe(sup.book.policy)
    assert "decode-0" in text and "gave up" in text and "3 restarts in 60 s" in text


def test_nothing_is_restarted_once_held():
    sup, clock, procs, spawned, events = _supervisor(RestartPolicy(backoff_s=0.0))
    sup.hold()
    procs["gateway"].returncode = 0
    clock.now += 10
    sup.step()
    assert spawned == [] and events == []


def test_a_restart_that_cannot_fork_is_retried_and_bounded():
    sup, clock, procs, spawned, events = _supervisor(
        RestartPolicy(max_restarts=2, window_s=60.0, backoff_s=1.0)
    )

    def broken(name: str) -> None:
        raise OSError("no more processes")

    sup.respawn = broken
    procs["decode-0"].returncode = 1
    for _ in range(6):
        sup.step()
        clock.now += 5.0
    assert [e.kind for e in events].count("gave_up") == 1
    assert any("could not be restarted" in e.describe(sup.book.policy) for e in events)
