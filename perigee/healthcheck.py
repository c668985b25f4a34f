"""Container healthchecks: ``python -m perigee.healthcheck --http URL`` or
``--nats URL --subject SUBJECT`` (healthy when the subject answers without an error)."""

import argparse
import asyncio
import sys
import urllib.request

import nats

from services.common.bus import ERROR_HEADER, inbox_prefix, servers_and_login


async def _nats_ok(url: str, subject: str, timeout: float) -> bool:
    # A cluster's comma list, and the service's own login ($NATS_USER/$NATS_PASSWORD).
    servers, user, password = servers_and_login(url)
    login = {"user": user, "password": password} if user is not None else {}
    nc = await nats.connect(
        servers,
        connect_timeout=timeout,
        max_reconnect_attempts=0,
        inbox_prefix=inbox_prefix(user),  # the only inbox its login may read
        **login,
    )
    try:
        msg = await nc.request(subject, b"{}", timeout=timeout)
        return not (msg.headers and ERROR_HEADER in msg.headers)
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perigee.healthcheck")
    p.add_argument("--http")
    p.add_argument("--nats")
    p.add_argument("--subject")
    p.add_argument("--timeout", type=float, default=2.0)
    a = p.parse_args(argv)
    try:
        if a.http:
            with urllib.request.urlopen(a.http, timeout=a.timeout) as r:
                return 0 if r.status == 200 else 1
        if a.nats and a.subject:
            return 0 if asyncio.run(_nats_ok(a.nats, a.subject, a.timeout)) else 1
    except Exception as e:  # noqa: BLE001 - any failure is "unhealthy"
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    p.error("give --http URL or --nats URL --subject SUBJECT")
    return 2


if __name__ == "__main__":
    sys.exit(main())
