"""``python -m services.store --nats URL --node p0 ...``: run one node's KV store."""

import argparse
import sys

import structlog
from nats.aio.client import Client as NATS

from services.common import defaults, metrics, runner, shared_flags, shell
from services.store import metrics as store_metrics
from services.store.node.server import StoreService
from services.transfer import data_auth


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.store", description=__doc__)
    shared_flags.Bus.add(p)
    p.add_argument("--node", required=True, help="node id (store subjects, kv events)")
    p.add_argument("--block-size", type=int, default=defaults.BLOCK_SIZE, help="tokens per block")
    p.add_argument("--block-bytes", type=int, default=131072, help="bytes per block slot")
    p.add_argument("--capacity-blocks", type=int, default=2048, help="slots in the arena")
    p.add_argument("--host", default="127.0.0.1", help="address the data plane binds")
    p.add_argument("--port", type=int, default=0, help="data plane port (0 = any free one)")
    p.add_argument(
        "--advertise-host",
        default=None,
        help="host peers use to reach this store (default: --host)",
    )
    p.add_argument("--announce-interval", type=float, default=1.0, help="seconds between announces")
    p.add_argument(
        "--sweep-interval", type=float, default=0.25, help="seconds between lease-expiry sweeps"
    )
    p.add_argument(
        "--peer-timeout",
        type=float,
        default=5.0,
        help="seconds a peer store may take to answer (plus size-based time)",
    )
    p.add_argument(
        "--transports",
        default="rdma,shm,tcp",
        help="transports KV bytes may take to and from peer stores (tcp is always "
        "on; rdma where a device exists; shm with peers on this host)",
    )
    p.add_argument(
        "--shm-copy-threads",
        type=int,
        default=2,
        help="threads that copy one big shared-memory transfer together (1: one copy "
        "thread, no helpers)",
    )
    p.add_argument(
        "--prefault",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="map the whole arena's pages once serving, in the background (commits its "
        "memory up front; an older kernel zeroes it before serving)",
    )
    p.add_argument(
        "--ssd-dir",
        default=None,
        help="SSD tier: folder for block files and their index (kept across restarts)",
    )
    p.add_argument(
        "--ssd-capacity-blocks",
        type=int,
        default=0,
        help="blocks the SSD tier holds (needs --ssd-dir; 0 = no SSD tier)",
    )
    p.add_argument(
        "--vram-capacity-blocks",
        type=int,
        default=0,
        help="blocks kept in GPU memory (skipped with a log line without CUDA)",
    )
    p.add_argument(
        "--replay-batches",
        type=int,
        default=1024,
        help="recent KV-event batches kept for the replay endpoint",
    )
    metrics.add_arguments(p)
    args = p.parse_args(argv)
    if not args.node or any(c in args.node for c in ".*> \t"):
        p.error(f"--node {args.node!r}: one NATS subject token (no '.', '*', '>' or spaces)")
    for name in ("block_size", "block_bytes", "capacity_blocks", "replay_batches"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    for name in ("ssd_capacity_blocks", "vram_capacity_blocks"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    bad = set(args.transports.split(",")) - {"", "rdma", "shm", "tcp"}
    if bad:
        p.error(f"--transports: unknown {sorted(bad)} (have rdma, shm, tcp)")
    if args.ssd_capacity_blocks and not args.ssd_dir:
        p.error("--ssd-capacity-blocks needs --ssd-dir")
    return args


async def main(args: argparse.Namespace) -> int:
    structlog.contextvars.bind_contextvars(node=args.node)

    def build(nc: NATS) -> StoreService:
        return StoreService(
            nc,
            node=args.node,
            block_size=args.block_size,
            block_bytes=args.block_bytes,
            capacity_blocks=args.capacity_blocks,
            host=args.host,
            port=args.port,
            advertise_host=args.advertise_host,
            announce_interval_s=args.announce_interval,
            sweep_interval_s=args.sweep_interval,
            peer_timeout_s=args.peer_timeout,
            transports=tuple(t for t in args.transports.split(",") if t) + ("tcp",),
            shm_copy_threads=args.shm_copy_threads,
            prefault=args.prefault,
            ssd_dir=args.ssd_dir,
            ssd_capacity_blocks=args.ssd_capacity_blocks,
            vram_capacity_blocks=args.vram_capacity_blocks,
            replay_batches=args.replay_batches,
        )

    return await shell.serve(
        "store",
        args,
        build,
        connection=f"store-{args.node}",
        sender=args.node,
        collector=store_metrics.store_collector,
        ready=lambda service: not service.failed.is_set(),
        failed=lambda service: service.failed,
        before_connect=data_auth.data_key,  # a placeholder key stops the store before it connects
    )


if __name__ == "__main__":
    sys.exit(runner.run(main(parse_args())))
