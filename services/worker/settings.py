"""What building a prefill or decode worker takes, for a fixed role and for a role
switch alike: the settings, and a builder per role. Each role's package builds its own
worker (``services.prefill.worker.build_prefill``, ``services.decode.worker.build_decode``);
the process's entry point (``python -m services.prefill|decode``) hands them over in
``WorkerSettings.builders``, so this package imports neither."""

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS

from bus_schemas.roles import ROLES
from services.common import admission_mode, defaults
from services.common.cost_model import CostModel
from services.common.kv_layout import KVLayout


@dataclass
class WorkerSettings:
    """What building a worker needs beyond its role: instance, node, layout, costs and hooks."""

    instance: str
    node: str
    layout: KVLayout
    cost: CostModel
    report_interval: float = 0.1
    calibrator: object = None  # the instance's Calibrator, kept across role switches
    commit_timeout: float = 2.0
    admit: Callable[..., str | None] | None = None  # DecodeWorker's admit hook (TBT gate)
    drain_quiet_s: float = 0.5
    lease_s: float = defaults.TX_LEASE_S  # store transactions this worker holds (renewed)
    reserver: Any = None  # PrefillWorker's reservations (None: the stores' endpoints)
    write_back: bool = True  # DecodeWorker: the answer's blocks go into the stores
    # role -> what builds its worker (from the role's own package; see the module doc)
    builders: Mapping[str, "Builder"] = field(default_factory=dict)


# (nc, store client, engine, settings) -> a started-able PrefillWorker / DecodeWorker
Builder = Callable[[NATS, Any, Any, WorkerSettings], Any]


def settings_from_args(
    args: argparse.Namespace,
    layout: KVLayout,
    cost: CostModel,
    calibrator: object = None,
    builders: Mapping[str, Builder] | None = None,
) -> WorkerSettings:
    admit = None
    # Built for a prefill instance too: a switchable one may serve as decode.
    if admission_mode.behaviour(args.admission_mode).decode_gate:
        from services.policy.decode_side_check import DecodeSideCheck

        admit = DecodeSideCheck(
            cost, args.tbt_slo, max_batch=args.max_batch, serve_when_idle=True
        ).as_admit_hook()
    return WorkerSettings(
        instance=args.instance,
        node=args.node,
        layout=layout,
        cost=cost,
        report_interval=args.report_interval,
        calibrator=calibrator,
        commit_timeout=args.commit_timeout,
        admit=admit,
        lease_s=args.lease,
        write_back=not getattr(args, "no_write_back", False),
        builders=dict(builders or {}),
    )


def make_worker(role: str, nc: NATS, store: Any, engine: Any, s: WorkerSettings) -> Any:
    """The worker of ``role``, built by that role's builder in ``s.builders``."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    build = s.builders.get(role)
    if build is None:
        raise ValueError(f"no builder for a {role} worker (builders: {sorted(s.builders)})")
    w = build(nc, store, engine, s)
    w.calibrator = s.calibrator
    return w
