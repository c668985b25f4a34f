"""The serving role as Kubernetes sees it: a switchable worker in a pod keeps the label
``perigee.io/role`` of its own pod equal to the role it serves.

The P/D controller moves capacity by RoleSwitch on the bus, and the pod drains and
serves the other role in place (services.worker.role_host). Without this, Kubernetes
would not know: ``kubectl get pods -L perigee.io/role`` would not show the split, a
Service or a PodMonitor could not select "the decode pods", and a restarted container
would come back in its StatefulSet's role, undoing the controller's decision. So:

- after each switch (and once at start), the worker PATCHes its pod's label through
  the API server, as the pod's service account (a Role allowing ``patch`` on pods in
  its namespace; deploy/k8s/base/rbac.yaml), in-cluster, with the mounted token;
- at start, a worker whose pod already carries the label (it was switched, then its
  container restarted) starts in that role; it reads the label from the downward API
  file (``/etc/podinfo/labels``), so it needs no API call to start.

A pod recreated by its StatefulSet starts without the label, in the StatefulSet's role.
A label that cannot be written is logged and retried; serving never waits for it.
"""

import asyncio
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import structlog

from bus_schemas.roles import ROLES
from services.common.clock import SleepFn

log = structlog.get_logger()

LABEL = "perigee.io/role"
LABELS_FILE = Path("/etc/podinfo/labels")  # the downward API volume's file
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class PodApiError(Exception):
    """No Kubernetes API for this pod (not in a pod, no service account), or it refused a PATCH."""

    pass


def role_from_labels(path: Path) -> str | None:
    """The role in a downward API labels file (``key="value"`` lines), if it names one."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == LABEL:
            role = value.strip().strip('"')
            return role if role in ROLES else None
    return None


@dataclass
class PodApi:
    """PATCH one pod's labels on the Kubernetes API server."""

    base_url: str  # https://<KUBERNETES_SERVICE_HOST>:<port>
    namespace: str
    pod: str
    token_file: Path
    ssl_context: ssl.SSLContext | bool = True  # True: the system's CAs

    @classmethod
    def in_cluster(
        cls, pod: str, sa_dir: Path = SA_DIR, env: Mapping[str, str] | None = None
    ) -> "PodApi":
        environ: Mapping[str, str] = os.environ if env is None else env
        host = environ.get("KUBERNETES_SERVICE_HOST")
        port = environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise PodApiError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST/PORT)")
        try:
            namespace = (sa_dir / "namespace").read_text().strip()
            ctx = ssl.create_default_context(cafile=str(sa_dir / "ca.crt"))
        except OSError as e:
            raise PodApiError(f"no service account mounted at {sa_dir}: {e}") from e
        host = f"[{host}]" if ":" in host else host  # an IPv6 service address
        return cls(f"https://{host}:{port}", namespace, pod, sa_dir / "token", ctx)

    async def set_label(self, key: str, value: str) -> None:
        url = f"{self.base_url}/api/v1/namespaces/{self.namespace}/pods/{self.pod}"
        # Read per call: projected service account tokens are rotated on disk.
        token = self.token_file.read_text().strip()
        headers = {
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/merge-patch+json",
        }
        body = {"metadata": {"labels": {key: value}}}
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.patch(url, json=body, headers=headers, ssl=self.ssl_context) as r:
                if r.status >= 300:
                    detail = (await r.text())[:300]
                    raise PodApiError(f"PATCH pod {self.pod}: HTTP {r.status} {detail}")


class PodRoleLabel:
    """Keeps ``perigee.io/role`` on the worker's pod equal to its role: ``publish`` is a
    RoleHost's ``on_role`` hook (a few tries with back-off; the newest role wins)."""

    def __init__(self, api: PodApi, tries: int = 5, sleep: SleepFn = asyncio.sleep) -> None:
        self.api, self.tries, self.sleep = api, tries, sleep
        self.role: str | None = None  # the newest role asked for
        self.written: str | None = None  # the last one the API server took
        self._lock = asyncio.Lock()  # one write at a time, so an older one never lands last

    async def publish(self, role: str) -> None:
        self.role = role
        async with self._lock:
            await self._write(role)

    async def _write(self, role: str) -> None:
        for attempt in range(self.tries):
            if self.role != role:
                return  # a newer switch writes its own
            try:
                await self.api.set_label(LABEL, role)
            except (PodApiError, aiohttp.ClientError, OSError, TimeoutError) as e:
                log.warning("pod_role_label_failed", role=role, attempt=attempt, error=str(e))
                await self.sleep(min(10.0, 0.5 * 2**attempt))
                continue
            self.written = role
            log.info("pod_role_labelled", pod=self.api.pod, role=role)
            return
