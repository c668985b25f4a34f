"""A switchable worker in a pod tells Kubernetes its role (services.worker.pod_role):
the label PATCH as the API server receives it (a loopback HTTP server stands in for
it), the downward API labels file a restarted worker starts from, in-cluster settings,
retries, and the newest role winning."""

import asyncio
import shutil

import certifi
import pytest
from aiohttp import web

from services.common.clock import ManualClock
from services.worker.main import parser
from services.worker.pod_role import LABEL, PodApi, PodApiError, PodRoleLabel, role_from_labels


class ApiServer:
    """Records each PATCH; answers ``fail`` of them with 503 first."""

    def __init__(self, fail: int = 0) -> None:
        self.patches: list[tuple[str, dict, dict]] = []
        self.fail = fail

    async def patch(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.patches.append((request.path, dict(request.headers), body))
        if self.fail:
            self.fail -= 1
            return web.Response(status=503, text="etcd is slow")
        return web.json_response({"kind": "Pod", "metadata": body["metadata"]})

    async def __aenter__(self) -> "ApiServer":
        app = web.Application()
        app.router.add_patch("/api/v1/namespaces/{ns}/pods/{pod}", self.patch)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def api(server: ApiServer, tmp_path, pod: str = "perigee-prefill-1") -> PodApi:
    token = tmp_path / "token"
    token.write_text("sa-token\n")
    return PodApi(f"http://127.0.0.1:{server.port}", "perigee", pod, token)


async def test_the_label_is_patched_on_the_workers_own_pod(tmp_path):
    async with ApiServer() as server:
        label = PodRoleLabel(api(server, tmp_path))
        await label.publish("decode")
    [(path, headers, body)] = server.patches
    assert path == "/api/v1/namespaces/perigee/pods/perigee-prefill-1"
    assert headers["Authorization"] == "Bearer sa-token"
    assert headers["Content-Type"] == "application/merge-patch+json"
    assert body == {"metadata": {"labels": {LABEL: "decode"}}}
    assert label.written == "decode"


async def test_a_refused_patch_is_tried_again_with_back_off(tmp_path):
    clock = ManualClock()

    async def sleep(dt: float) -> None:
        clock.advance(dt)

    async with ApiServer(fail=2) as server:
        label = PodRoleLabel(api(server, tmp_path), sleep=sleep)
        await label.publish("decode")
    assert len(server.patches) == 3 and label.written == "decode"
    assert clock.now() == 0.5 + 1.0


async def test_the_newest_role_lands_last(tmp_path):
    gate = asyncio.Event()

    async with ApiServer(fail=1) as server:

        async def sleep(_dt: float) -> None:
            await gate.wait()  # the first write's retry waits until the switch back

        label = PodRoleLabel(api(server, tmp_path), sleep=sleep)
        first = asyncio.create_task(label.publish("decode"))
        while not server.patches:
            await asyncio.sleep(0)
        second = asyncio.create_task(label.publish("prefill"))
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, second)
    # The refused "decode" is not written again once "prefill" was asked for.
    assert [b["metadata"]["labels"][LABEL] for _, _, b in server.patches] == ["decode", "prefill"]
    assert label.written == "prefill"


async def test_an_api_server_that_never_takes_it_is_given_up_without_raising(tmp_path):
    async def sleep(_dt: float) -> None:
        return None

    async with ApiServer(fail=100) as server:
        label = PodRoleLabel(api(server, tmp_path), tries=3, sleep=sleep)
        await label.publish("decode")
    assert len(server.patches) == 3 and label.written is None


def test_role_from_the_downward_api_labels_file(tmp_path):
    f = tmp_path / "labels"
    f.write_text(
        'app.kubernetes.io/name="perigee-prefill"\n'
        f'{LABEL}="decode"\n'
        'perigee.io/initial-role="prefill"\n'
    )
    assert role_from_labels(f) == "decode"
    f.write_text('perigee.io/initial-role="prefill"\n')  # never switched
    assert role_from_labels(f) is None
    f.write_text(f'{LABEL}="gateway"\n')  # not a serving role
    assert role_from_labels(f) is None
    assert role_from_labels(tmp_path / "missing") is None


def test_in_cluster_settings(tmp_path):
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "namespace").write_text("perigee")
    with pytest.raises(PodApiError, match="not in a Kubernetes pod"):
        PodApi.in_cluster("p-0", sa, env={})
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(PodApiError, match="no service account"):
        PodApi.in_cluster("p-0", sa, env=env)  # no ca.crt
    shutil.copy(certifi.where(), sa / "ca.crt")  # any real CA bundle parses
    a = PodApi.in_cluster("p-0", sa, env=env)
    assert (a.base_url, a.namespace, a.pod, a.token_file) == (
        "https://10.96.0.1:443",
        "perigee",
        "p-0",
        sa / "token",
    )
    v6 = PodApi.in_cluster("p-0", sa, env={**env, "KUBERNETES_SERVICE_HOST": "fd00::1"})
    assert v6.base_url == "https://[fd00::1]:443"


def test_the_worker_flags_default_to_the_manifests_paths():
    a = parser("prefill", "p0", None).parse_args(["--switchable", "--pod-role-label"])
    assert a.pod_role_label and a.pod_labels_file == "/etc/podinfo/labels"
