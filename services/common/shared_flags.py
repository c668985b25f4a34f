"""The flags several services take, declared once, as groups: each group adds its flags
to a service's parser (:meth:`add`), reads them back (:meth:`of`) and renders them for
a child's command line (:meth:`Group.args`, :meth:`Group.argv`), so that what ``perigee up``,
compose.yaml and deploy/k8s pass (perigee.deploy_spec) and what a service parses come
from one place. Their defaults live in services.common.defaults; each service says in
``use`` what it does with them.

A field set to None is not passed (the service's default holds); a value may be a
string where a deployment fills it in (Kubernetes' ``$(TBT_SLO)``)."""

import argparse
from dataclasses import dataclass, fields
from typing import NamedTuple

from services.common import defaults, intake_queue, metrics

DEFAULT_NATS = "nats://127.0.0.1:4222"


class Arg(NamedTuple):
    """One flag on a command line, with its value (None: a switch)."""

    flag: str
    value: str | None = None


def split(args: list[Arg]) -> list[str]:
    """``--flag value`` (perigee up's children)."""
    return [t for a in args for t in ((a.flag,) if a.value is None else (a.flag, a.value))]


def joined(args: list[Arg]) -> list[str]:
    """``--flag=value`` (compose.yaml and deploy/k8s)."""
    return [a.flag if a.value is None else f"{a.flag}={a.value}" for a in args]


class Group:
    """Flags as fields: ``--<field-name>`` with the field's value, None not passed."""

    def args(self) -> list[Arg]:
        return [
            Arg("--" + f.name.replace("_", "-"), str(v))
            for f in fields(self)  # type: ignore[arg-type]
            if (v := getattr(self, f.name)) is not None
        ]

    def argv(self) -> list[str]:
        return split(self.args())


@dataclass(frozen=True)
class Bus(Group):
    """Which NATS server a service joins, and how much it logs."""

    nats: str = DEFAULT_NATS
    log_level: str | None = "INFO"

    @staticmethod
    def add(p: argparse.ArgumentParser) -> None:
        p.add_argument("--nats", default=DEFAULT_NATS, help="NATS server URL")
        p.add_argument("--log-level", default="INFO")

    @classmethod
    def of(cls, ns: argparse.Namespace) -> "Bus":
        return cls(ns.nats, ns.log_level)


@dataclass(frozen=True)
class Slos(Group):
    """The stack's TTFT and TBT SLOs, seconds."""

    ttft_slo: float | str | None = defaults.TTFT_SLO_S
    tbt_slo: float | str | None = defaults.TBT_SLO_S

    @staticmethod
    def add(
        p: argparse.ArgumentParser, use: str = "", *, ttft: bool = True, unset: bool = False
    ) -> None:
        """``--ttft-slo`` (unless ``ttft`` is False) and ``--tbt-slo``; ``unset``: their
        default is None, for a caller that settles them (perigee up, by engine)."""
        tail = f": {use}" if use else ""
        if ttft:
            p.add_argument(
                "--ttft-slo",
                type=float,
                default=None if unset else defaults.TTFT_SLO_S,
                help=f"TTFT SLO, s{tail}",
            )
        p.add_argument(
            "--tbt-slo",
            type=float,
            default=None if unset else defaults.TBT_SLO_S,
            help=f"TBT SLO, s{tail}",
        )

    def argv(self, *, ttft: bool = True) -> list[str]:
        return split((self if ttft else Slos(None, self.tbt_slo)).args())


@dataclass(frozen=True)
class DeadAfter(Group):
    """How long an instance may stay silent before it counts as dead, seconds."""

    dead_after: float | str | None = defaults.DEAD_AFTER_S

    @staticmethod
    def add(p: argparse.ArgumentParser, use: str = "") -> None:
        p.add_argument(
            "--dead-after",
            type=float,
            default=defaults.DEAD_AFTER_S,
            help="seconds without a load report before an instance counts as dead"
            + (f" ({use})" if use else ""),
        )


@dataclass(frozen=True)
class Metrics(Group):
    """Where a service serves Prometheus ``/metrics``, ``/health`` and ``/ready``
    (services.common.metrics; port 0: not served)."""

    metrics_port: int | str | None = 0
    metrics_host: str | None = "127.0.0.1"

    @staticmethod
    def add(p: argparse.ArgumentParser) -> None:
        metrics.add_arguments(p)

    @classmethod
    def of(cls, ns: argparse.Namespace) -> "Metrics":
        return cls(ns.metrics_port, ns.metrics_host)


@dataclass(frozen=True)
class Intake(Group):
    """How admission and the conductor serve their JetStream work queues
    (services.common.intake_queue)."""

    durable: bool = False
    ack_wait_s: float = intake_queue.ACK_WAIT_S
    patience_s: float = intake_queue.PATIENCE_S

    @staticmethod
    def add(p: argparse.ArgumentParser, what: str = "a request") -> None:
        p.add_argument(
            "--durable-intake",
            action=argparse.BooleanOptionalAction,
            default=False,
            help="serve the JetStream intake work queue (services.common.intake_queue); "
            "default: core NATS only (a dead copy's requests are resent by the gateway "
            "from the presence beats)",
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

    def args(self) -> list[Arg]:
        return [
            Arg("--durable-intake" if self.durable else "--no-durable-intake"),
            Arg("--intake-ack-wait", str(self.ack_wait_s)),
            Arg("--intake-patience", str(self.patience_s)),
        ]
