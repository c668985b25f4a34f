"""The one place a prefill or decode worker is built, for a fixed role and for a
role switch alike."""

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS

from bus_schemas.roles import ROLES, Role
from services.common import admission_mode
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
    lease_s: float = 10.0  # store transactions this worker holds (renewed)
    reserver: Any = None  # PrefillWorker's reservations (None: the stores' endpoints)
    write_back: bool = True  # DecodeWorker: the answer's blocks go into the stores


def settings_from_args(
    args: argparse.Namespace, layout: KVLayout, cost: CostModel, calibrator: object = None
) -> WorkerSettings:
    admit = None
    # Built for a prefill instance too: a switchable one may serve as decode.
    if admission_mode.behaviour(args.admission_mode).decode_gate:
        from services.decode.side_check import DecodeSideCheck

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
    )


def make_worker(role: str, nc: NATS, store: Any, engine: Any, s: WorkerSettings) -> Any:
    if role == Role.PREFILL:
        from services.prefill.worker import PrefillWorker

        w: Any = PrefillWorker(
            nc,
            store,
            engine,
            instance=s.instance,
            node=s.node,
            layout=s.layout,
            cost=s.cost,
            report_interval=s.report_interval,
            lease_s=s.lease_s,
            reserver=s.reserver,
        )
    elif role == Role.DECODE:
        from services.decode.worker import DecodeWorker

        w = DecodeWorker(
            nc,
            store,
            engine,
            instance=s.instance,
            node=s.node,
            layout=s.layout,
            report_interval=s.report_interval,
            commit_timeout=s.commit_timeout,
            admit=s.admit,
            lease_s=s.lease_s,
            write_back=s.write_back,
        )
    else:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    w.calibrator = s.calibrator
    return w
