"""The flags several services take, declared once, as groups: each group adds its flags
to a service's parser (:meth:`add`), reads them back (:meth:`of`) and renders them for
a child's command line (:meth:`argv`), so that what ``perigee up`` passes and what a
service parses come from one place. Their defaults live in services.common.defaults;
each service says in ``use`` what it does with them."""

import argparse
from dataclasses import dataclass

from services.common import defaults, intake_queue

DEFAULT_NATS = "nats://127.0.0.1:4222"


@dataclass(frozen=True)
class Bus:
    """Which NATS server a service joins, and how much it logs."""

    nats: str = DEFAULT_NATS
    log_level: str = "INFO"

    @staticmethod
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("--nats", default=DEFAULT_NATS, help="NATS server URL")
        p.add_argument("--log-level", default="INFO")

    @classmethod
    def of(cls, ns: argparse.Namespace) -> "Bus":
        return cls(ns.nats, ns.log_level)

    def argv(self) -> list[str]:
        return ["--nats", self.nats, "--log-level", self.log_level]


@dataclass(frozen=True)
class Slos:
    """The stack's TTFT and TBT SLOs, seconds."""

    ttft_slo: float = defaults.TTFT_SLO_S
    tbt_slo: float = defaults.TBT_SLO_S

    @staticmethod
    def add(p: argparse.ArgumentParser, use: str = "", *, ttft: bool = True) -> None:
        """``--ttft-slo`` (unless ``ttft`` is False) and ``--tbt-slo``."""
        tail = f": {use}" if use else ""
        if ttft:
            p.add_argument(
                "--ttft-slo", type=float, default=defaults.TTFT_SLO_S, help=f"TTFT SLO, s{tail}"
            )
        p.add_argument(
            "--tbt-slo", type=float, default=defaults.TBT_SLO_S, help=f"TBT SLO, s{tail}"
        )

    def argv(self, *, ttft: bool = True) -> list[str]:
        out = ["--ttft-slo", str(self.ttft_slo)] if ttft else []
        return [*out, "--tbt-slo", str(self.tbt_slo)]


@dataclass(frozen=True)
class DeadAfter:
    """How long an instance may stay silent before it counts as dead, seconds."""

    dead_after: float = defaults.DEAD_AFTER_S

    @staticmethod
    def add(p: argparse.ArgumentParser, use: str = "") -> None:
        p.add_argument(
            "--dead-after",
            type=float,
            default=defaults.DEAD_AFTER_S,
            help="seconds without a load report before an instance counts as dead"
            + (f" ({use})" if use else ""),
        )

    def argv(self) -> list[str]:
        return ["--dead-after", str(self.dead_after)]


@dataclass(frozen=True)
class Intake:
    """How admission and the conductor serve their JetStream work queues
    (services.common.intake_queue)."""

    durable: bool = True
    ack_wait_s: float = intake_queue.ACK_WAIT_S
    patience_s: float = intake_queue.PATIENCE_S

    @staticmethod
    def add(p: argparse.ArgumentParser, what: str = "a request") -> None:
        p.add_argument(
            "--durable-intake",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="serve the JetStream intake work queue (services.common.intake_queue); "
            "--no-durable-intake: core NATS only, for a bus without JetStream",
        )
        p.add_argument(
            "--intake-ack-wait",
            type=float,
            default=intake_queue.ACK_WAIT_S,
            help="seconds a request held by a copy that died waits before another copy gets it",
        )
        intake_queue.add_patience_argument(p, what)

    @classmethod
    def of(cls, ns: argparse.Namespace) -> "Intake":
        return cls(ns.durable_intake, ns.intake_ack_wait, ns.intake_patience)

    def argv(self) -> list[str]:
        return [
            "--durable-intake" if self.durable else "--no-durable-intake",
            "--intake-ack-wait",
            str(self.ack_wait_s),
            "--intake-patience",
            str(self.patience_s),
        ]
