"""deploy/k8s: the Kustomize base and its cpu/gpu overlays, rendered with the real
``kubectl kustomize``, every object validated against the Kubernetes schemas
(kubernetes-validate, offline), and the things that matter checked on the rendered
objects: NATS clustering and JetStream volumes (the config also passes the real
``nats-server -t``), probes, GPUs, shared memory, Secrets, resources, scaling, and every
perigee container's command line parsed by that service's own argparse parser, so a
manifest cannot drift from the code."""

import base64
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from perigee import models
from perigee.natsd import nats_server_binary
from services.authn import nkeys
from services.common import admission_mode
from services.common.model_spec import ModelSpec

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
TREES = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu"}
K8S_VERSION = "1.32.0"  # the kubectl on these machines (client v1.32)
PARSERS = {
    m: f"{m}.__main__"
    for m in (
        "services.gateway",
        "services.admission",
        "services.conductor",
        "services.prefill",
        "services.decode",
        "services.store",
        "services.authn",
    )
}
# Stand-ins for what the kubelet fills in (downward API).
FIELD_REFS = {"metadata.name": "perigee-prefill-0", "status.podIP": "10.0.0.7"}

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None,
    reason="kubectl is not installed (kubectl kustomize renders deploy/k8s)",
)


def render(tree: Path) -> list[dict]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(tree)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(tree) for name, tree in TREES.items()}


def objs(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def containers(docs: list[dict]):
    for w in workloads(docs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            yield w, c


def perigee_containers(docs: list[dict]):
    for w, c in containers(docs):
        if c["image"].split(":")[0] == "perigee":
            yield w, c


def by_name(docs: list[dict], kind: str, prefix: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(prefix))


# -- the kubelet's view of a container: its environment and expanded arguments -----------


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names are replaced, $$ escapes a $."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        s,
    )


def environment(docs: list[dict], c: dict) -> dict[str, str]:
    cms, secrets = objs(docs, "ConfigMap"), objs(docs, "Secret")
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(cms[src["configMapRef"]["name"]]["data"])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        ref = e["valueFrom"]
        if "fieldRef" in ref:
            env[e["name"]] = FIELD_REFS[ref["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in ref:  # a container's own limit: its declared value
            r = ref["resourceFieldRef"]
            kind, _, what = r["resource"].partition(".")
            env[e["name"]] = str(c["resources"][kind][what])
        elif "secretKeyRef" in ref:
            s = secrets[ref["secretKeyRef"]["name"]]
            env[e["name"]] = base64.b64decode(s["data"][ref["secretKeyRef"]["key"]]).decode()
        else:
            cm = cms[ref["configMapKeyRef"]["name"]]
            env[e["name"]] = cm["data"][ref["configMapKeyRef"]["key"]]
    return env


def parsed(docs: list[dict], c: dict):
    """The container's arguments parsed by its service's own parser."""
    env = environment(docs, c)
    module, *argv = [expand(a, env) for a in c["args"]]
    parse = importlib.import_module(PARSERS[module]).parse_args
    try:
        return module, parse(argv)
    except SystemExit as e:
        pytest.fail(f"{c['name']}: {module} rejects {argv} (exit {e.code})")


def flag(c: dict, name: str) -> str:
    return next(a.split("=", 1)[1] for a in c["args"] if a.startswith(name + "="))


def port_number(c: dict, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c["ports"] if p["name"] == port)


# -- schemas ---------------------------------------------------------------------------


@pytest.mark.parametrize("tree", list(TREES))
def test_every_object_validates_against_the_kubernetes_schemas(rendered, tree):
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (make install)"
    )
    docs = rendered[tree]
    assert len(docs) > 20
    for d in docs:
        try:
            kv.validate(d, K8S_VERSION, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{tree}: {d['kind']}/{d['metadata']['name']}: {e.message} at {e.path}")


def test_validation_catches_a_broken_object(rendered):
    """The validator is not a rubber stamp: a misspelt field is rejected."""
    kv = pytest.importorskip("kubernetes_validate")
    gw = by_name(rendered["base"], "Deployment", "perigee-gateway")
    bad = yaml.safe_load(yaml.safe_dump(gw))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


# -- NATS ------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", list(TREES))
def test_nats_is_a_cluster_of_three_with_jetstream_on_persistent_volumes(rendered, tree, tmp_path):
    docs = rendered[tree]
    sts = objs(docs, "StatefulSet")["perigee-nats"]
    assert sts["spec"]["replicas"] == 3
    headless = objs(docs, "Service")[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    [claim] = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    [c] = sts["spec"]["template"]["spec"]["containers"]
    data = next(m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    conf_vol = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if "configMap" in v)
    conf = objs(docs, "ConfigMap")[conf_vol["configMap"]["name"]]["data"]["nats.conf"]
    routes = set(re.findall(r"nats://([\w.-]+):6222", conf))
    assert routes == {f"perigee-nats-{i}.{headless['metadata']['name']}" for i in range(3)}
    assert "authorization" in conf
    store_dir = re.search(r"store_dir:\s*(\S+)", conf).group(1)
    assert store_dir.startswith(data["mountPath"] + "/")
    assert 6222 in [p["containerPort"] for p in c["ports"]]
    # The real server accepts the file with the environment the pod gives it.
    path = tmp_path / "nats.conf"
    path.write_text(conf.replace(store_dir, str(tmp_path / "js")))
    env = environment(docs, c)

    def check(env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            [nats_server_binary(), "-t", "-c", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, **env},
        )

    # The template's auth-callout key is refused by the server itself; a keygen'd one
    # (python -m services.authn keygen) is taken.
    r = check(env)
    assert r.returncode != 0 and "nkey" in r.stderr + r.stdout, r.stderr + r.stdout
    env["AUTHN_ISSUER"] = nkeys.KeyPair.generate().public
    r = check(env)
    assert r.returncode == 0, r.stderr + r.stdout


# -- probes, metrics -------------------------------------------------------------------


@pytest.mark.parametrize("tree", list(TREES))
def test_probes_point_at_what_each_service_serves(rendered, tree):
    docs = rendered[tree]
    seen = set()
    for _, c in perigee_containers(docs):
        module, args = parsed(docs, c)
        seen.add(module)
        if module == "services.gateway":
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            for p in ("readinessProbe", "livenessProbe"):
                assert port_number(c, c[p]["httpGet"]["port"]) == args.port
            continue
        # The others serve /metrics, /health and /ready on --metrics-port, bound on every
        # address (services.common.metrics.MetricsServer).
        assert args.metrics_host == "0.0.0.0"
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        if "startupProbe" in c:
            assert c["startupProbe"]["httpGet"]["path"] == "/health"
        for p in ("livenessProbe", "readinessProbe", "startupProbe"):
            if p in c:
                assert port_number(c, c[p]["httpGet"]["port"]) == args.metrics_port
    assert seen == set(PARSERS)


@pytest.mark.parametrize("tree", list(TREES))
def test_every_perigee_pod_is_annotated_for_prometheus_on_a_metrics_port(rendered, tree):
    docs = rendered[tree]
    for w in workloads(docs):
        t = w["spec"]["template"]
        if not any(c["image"].startswith("perigee") for c in t["spec"]["containers"]):
            continue
        a = t["metadata"]["annotations"]
        assert a["prometheus.io/scrape"] == "true" and a["prometheus.io/path"] == "/metrics"
        served = set()
        for c in t["spec"]["containers"]:
            _, args = parsed(docs, c)
            served.add(getattr(args, "metrics_port", None) or args.port)
        assert int(a["prometheus.io/port"]) in served, w["metadata"]["name"]


@pytest.mark.parametrize("tree", list(TREES))
def test_every_service_that_takes_the_slos_gets_the_configmaps(rendered, tree):
    """TTFT_SLO/TBT_SLO of perigee-config reach admission, the conductors and the
    gateway (which reports them on GET /v1/perigee/config, read by perigee replay); the
    TBT SLO reaches the workers too (a decode's check in the baseline admission mode)."""
    docs = rendered[tree]
    config = objs(docs, "ConfigMap")
    [cm] = [d["data"] for n, d in config.items() if n.startswith("perigee-config")]
    seen = set()
    for _, c in perigee_containers(docs):
        module, args = parsed(docs, c)
        if hasattr(args, "ttft_slo"):
            assert args.ttft_slo == float(cm["TTFT_SLO"]), (module, args.ttft_slo)
        if hasattr(args, "tbt_slo"):
            seen.add(module)
            assert args.tbt_slo == float(cm["TBT_SLO"]), (module, args.tbt_slo)
    assert {
        "services.gateway",
        "services.admission",
        "services.conductor",
        "services.prefill",
        "services.decode",
    } <= seen
    if tree == "cpu":
        assert (float(cm["TTFT_SLO"]), float(cm["TBT_SLO"])) == (15.0, 1.0)


@pytest.mark.parametrize("tree", list(TREES))
def test_every_service_follows_the_one_admission_mode_of_perigee_config(
    rendered, tree, monkeypatch
):
    """PERIGEE_ADMISSION_MODE lives once, in perigee-config; every admission, conductor
    and worker container gets it, parses it (its own parser, its own environment) and
    maps it to its behaviour; no container names another mode on its command line."""
    docs = rendered[tree]
    [cm] = [d["data"] for n, d in objs(docs, "ConfigMap").items() if n.startswith("perigee-config")]
    mode = admission_mode.parse(cm[admission_mode.ENV])
    assert mode == admission_mode.DEFAULT  # the base and overlays serve the default
    seen = set()
    for _, c in perigee_containers(docs):
        env = environment(docs, c)
        module = c["args"][0]
        if module not in admission_mode.SERVICES:
            continue
        assert env.get(admission_mode.ENV) == str(mode), c["name"]
        monkeypatch.setenv(admission_mode.ENV, env[admission_mode.ENV])
        _, args = parsed(docs, c)
        assert args.admission_mode == mode, (module, args.admission_mode)
        seen.add(module)
    assert seen == set(admission_mode.SERVICES)


# -- resources, GPUs, shared memory ----------------------------------------------------


@pytest.mark.parametrize("tree", list(TREES))
def test_every_container_has_requests_and_limits(rendered, tree):
    for w, c in containers(rendered[tree]):
        r = c.get("resources", {})
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(r.get(kind, {})), (w["metadata"]["name"], c["name"])


def test_only_the_gpu_overlay_asks_for_gpus(rendered):
    for tree in ("base", "cpu"):
        for _, c in containers(rendered[tree]):
            assert "nvidia.com/gpu" not in str(c.get("resources")), (tree, c["name"])
    workers = [(w, c) for w, c in containers(rendered["gpu"]) if c["name"] == "worker"]
    assert {w["metadata"]["name"] for w, _ in workers} == {"perigee-prefill", "perigee-decode"}
    for w, c in workers:
        r = c["resources"]
        assert r["requests"]["nvidia.com/gpu"] == r["limits"]["nvidia.com/gpu"] == 1
        assert parsed(rendered["gpu"], c)[1].engine == "vllm"
        assert any(
            t["key"] == "nvidia.com/gpu" for t in w["spec"]["template"]["spec"]["tolerations"]
        )
    gpu_containers = [
        c["name"]
        for _, c in containers(rendered["gpu"])
        if "nvidia.com/gpu" in str(c.get("resources"))
    ]
    assert sorted(gpu_containers) == ["worker", "worker"]
    for _, c in containers(rendered["cpu"]):
        if c["name"] == "worker":
            assert parsed(rendered["cpu"], c)[1].engine == "vllm"
    for _, c in containers(rendered["base"]):
        if c["name"] == "worker":
            assert parsed(rendered["base"], c)[1].engine == "mock"


def _quantity(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    m = re.fullmatch(r"(\d+)([KMGT]i)?", str(q))
    return int(m.group(1)) * units.get(m.group(2), 1)


def image_models_dir() -> str:
    """Where the image keeps prepared models (the Dockerfile's PERIGEE_MODELS_DIR)."""
    m = re.search(r"^ENV .*\bPERIGEE_MODELS_DIR=(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert m, "the Dockerfile sets PERIGEE_MODELS_DIR"
    return m.group(1)


def local_model(image_path: str) -> Path | None:
    """This checkout's copy of a model folder named by its path in the image: /app is the
    repository (models/tiny-llama); the image's models folder holds what `perigee model
    prepare` wrote, here under ~/.cache/perigee/models (None if not prepared here)."""
    p = Path(image_path)
    if p.is_relative_to("/app"):
        return ROOT / p.relative_to("/app")
    assert p.parent == Path(image_models_dir()), image_path
    local = models.models_dir() / p.name
    return local if models.is_prepared(local) else None


def test_the_cpu_overlay_serves_the_default_model_with_stores_sized_for_it(rendered):
    """overlays/cpu: SmolLM2-135M-Instruct from the image's /models (Dockerfile MODEL=smollm2),
    each store's block exactly the model's KV bytes per block at the overlay's block size,
    its arena within the /dev/shm tmpfs and the store's memory limit."""
    docs = rendered["cpu"]
    [cm] = [d["data"] for n, d in objs(docs, "ConfigMap").items() if n.startswith("perigee-config")]
    assert cm["MODEL_DIR"] == f"{image_models_dir()}/{models.DEFAULT_MODEL_NAME}"
    assert cm["ENGINE"] == "vllm"
    block_bytes = set()
    for role in ("prefill", "decode"):
        spec = objs(docs, "StatefulSet")[f"perigee-{role}"]["spec"]["template"]["spec"]
        cs = {c["name"]: c for c in spec["containers"]}
        _, store = parsed(docs, cs["store"])
        _, worker = parsed(docs, cs["worker"])
        assert worker.model_dir == cm["MODEL_DIR"]
        assert store.block_bytes == int(cm["KV_BLOCK_BYTES"])
        assert store.capacity_blocks == int(cm["STORE_CAPACITY_BLOCKS"]) == 1024
        [shm] = [v for v in spec["volumes"] if v["name"] == "shm"]
        arena = store.capacity_blocks * store.block_bytes
        assert _quantity(shm["emptyDir"]["sizeLimit"]) >= arena
        assert _quantity(cs["store"]["resources"]["limits"]["memory"]) >= arena
        block_bytes.add((store.block_bytes, store.block_size))
    [(size, block_size)] = block_bytes
    # The gateway and every worker tokenize with the same model.
    for _, c in perigee_containers(docs):
        args = parsed(docs, c)[1]
        if hasattr(args, "model_dir"):
            assert args.model_dir == cm["MODEL_DIR"], c["name"]
    folder = models.default_model_dir()
    if not models.is_prepared(folder):
        pytest.skip(
            f"{models.DEFAULT_MODEL_NAME} is not prepared in {folder} (make model): "
            f"KV_BLOCK_BYTES={size} not checked against the model"
        )
    assert size == ModelSpec.from_dir(folder).block_bytes(block_size)


@pytest.mark.parametrize("tree", list(TREES))
def test_each_serving_pod_holds_its_store_and_worker_on_one_shared_memory(rendered, tree):
    docs = rendered[tree]
    sts = objs(docs, "StatefulSet")
    for role in ("prefill", "decode"):
        spec = sts[f"perigee-{role}"]["spec"]["template"]["spec"]
        [shm] = [v for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        cs = {c["name"]: c for c in spec["containers"]}
        assert set(cs) == {"store", "worker"}
        for c in cs.values():
            assert {"name": shm["name"], "mountPath": "/dev/shm"} in c["volumeMounts"]
        _, store = parsed(docs, cs["store"])
        module, worker = parsed(docs, cs["worker"])
        assert module == f"services.{role}"
        # One node: the worker uses this pod's store, whose arena fits the tmpfs.
        assert worker.node == store.node == FIELD_REFS["metadata.name"]
        assert worker.block_size == store.block_size
        arena = store.capacity_blocks * store.block_bytes
        assert _quantity(shm["emptyDir"]["sizeLimit"]) >= arena
        assert _quantity(cs["store"]["resources"]["limits"]["memory"]) >= arena
        # The store's block is the model's KV of one block (the worker checks it at start).
        model = local_model(worker.model_dir)
        if model is not None:
            assert store.block_bytes == ModelSpec.from_dir(model).block_bytes(store.block_size)
        # Peers reach the store at the pod's address on a declared port, which it binds
        # there only (not every address: test_the_data_plane_is_fenced_to_serving_pods).
        assert store.advertise_host == store.host == FIELD_REFS["status.podIP"]
        assert store.port in [p["containerPort"] for p in cs["store"]["ports"]]


# -- credentials -----------------------------------------------------------------------


@pytest.mark.parametrize("tree", list(TREES))
def test_credentials_come_from_secrets(rendered, tree):
    docs = rendered[tree]
    secrets = objs(docs, "Secret")
    for w, c in containers(docs):
        env = {e["name"]: e for e in c.get("env", [])}
        if c["image"].startswith("perigee") and "NATS_PASSWORD_FILE" in env:
            # A serving pod: no password at all, its projected token (the auth callout).
            assert "NATS_PASSWORD" not in env
            continue
        names = {"NATS_USER", "NATS_PASSWORD"} | (
            {"PERIGEE_API_KEY"} if c["name"] == "gateway" else set()
        )
        if not c["image"].startswith("perigee"):  # nats-server: every static login
            names = {n for n in env if n.endswith(("_NATS_USER", "_NATS_PASSWORD"))}
            assert len(names) == 10, names  # admin, gateway, admission, conductor, authn
        for name in names:
            ref = env[name]["valueFrom"]["secretKeyRef"]
            assert ref["key"] in secrets[ref["name"]]["data"], (w["metadata"]["name"], name)
        if not c["image"].startswith("perigee"):
            continue
        password = environment(docs, c)["NATS_PASSWORD"]
        # No credential is written into a manifest: args and values only refer to it.
        assert password not in str(c.get("args", [])) + str([e.get("value") for e in env.values()])
        # No password on a command line (the process's argv): the URL has no login,
        # the service takes NATS_USER/NATS_PASSWORD from its environment.
        assert flag(c, "--nats") == "$(NATS_URL)"
        url = environment(docs, c)["NATS_URL"]
        assert url == "nats://perigee-nats:4222", url
        assert password not in " ".join(expand(a, environment(docs, c)) for a in c["args"])
    [data] = [s["data"] for s in secrets.values()]
    passwords = [k for k in data if k.endswith("-nats-password")]
    assert len(passwords) == 5  # the admin and one per control-plane role
    for k in [*passwords, "authn-issuer-seed", "authn-issuer-public"]:
        assert "REPLACE-ME" in base64.b64decode(data[k]).decode(), k


DATA_PLANE = ("services.store", "services.prefill", "services.decode")


@pytest.mark.parametrize("tree", list(TREES))
def test_every_store_and_worker_has_the_data_key_from_the_secret(rendered, tree):
    """PERIGEE_DATA_KEY (services.transfer.data_auth) is one value per deployment, in every store's
    and worker's environment from the Secret, on no command line, and only where the
    data plane needs it."""
    docs = rendered[tree]
    secrets = objs(docs, "Secret")
    refs = set()
    for w, c in perigee_containers(docs):
        module = c["args"][0]
        env = {e["name"]: e for e in c.get("env", [])}
        where = (w["metadata"]["name"], c["name"])
        if module not in DATA_PLANE:
            assert "PERIGEE_DATA_KEY" not in env, where
            continue
        ref = env["PERIGEE_DATA_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref["key"] in secrets[ref["name"]]["data"], where
        refs.add((ref["name"], ref["key"]))
    [secret] = secrets  # the generated perigee-credentials-<hash>
    assert refs == {(secret, "data-key")}  # one key shared by all
    [data] = [s["data"] for s in secrets.values()]
    key = base64.b64decode(data["data-key"]).decode()
    assert "REPLACE-ME" in key  # the template: the services refuse it at start
    for _, c in containers(docs):
        env = environment(docs, c) if c["image"].startswith("perigee") else {}
        argv = " ".join(expand(a, env) for a in c.get("command", []) + c.get("args", []))
        assert key not in argv and "PERIGEE_DATA_KEY" not in argv, c["name"]
        assert key not in str([e.get("value") for e in c.get("env", [])]), c["name"]


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # what these manifests use
    return selector.get("matchLabels", {}).items() <= labels.items()


def _admits_port(rule: dict, port: int, name: str) -> bool:
    if not rule.get("ports"):
        return True  # a rule without ports admits every port
    for p in rule["ports"]:
        want = p.get("port")
        if want is None or want == name:
            return True
        if isinstance(want, int) and want <= port <= p.get("endPort", want):
            return True
    return False


@pytest.mark.parametrize("tree", list(TREES))
def test_the_data_plane_is_fenced_to_serving_pods(rendered, tree):
    """Every store binds its data port to the pod IP, and a NetworkPolicy admits only the
    serving pods (the prefill and decode StatefulSets', either role) to it, while the
    metrics and probe ports stay open."""
    docs = rendered[tree]
    sts = objs(docs, "StatefulSet")
    serving = {"perigee-prefill", "perigee-decode"}
    pods = {
        w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads(docs)
    }
    policies = [
        p for p in objs(docs, "NetworkPolicy").values() if "Ingress" in p["spec"]["policyTypes"]
    ]
    for name in serving:
        spec = sts[name]["spec"]["template"]["spec"]
        store = next(c for c in spec["containers"] if c["name"] == "store")
        args = parsed(docs, store)[1]
        assert args.host == FIELD_REFS["status.podIP"], name  # not 0.0.0.0
        assert flag(store, "--host") == "$(POD_IP)"
        env = {e["name"]: e for e in store["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        port_name = next(p["name"] for p in store["ports"] if p["containerPort"] == args.port)
        fencing = [p for p in policies if _selects(p["spec"]["podSelector"], pods[name])]
        assert fencing, f"no NetworkPolicy selects {name}'s pods"
        rules = [
            r
            for p in fencing
            for r in p["spec"].get("ingress", [])
            if _admits_port(r, args.port, port_name)
        ]
        assert rules, f"nothing may reach {name}'s data port"
        for r in rules:
            assert r.get("from"), f"{name}: a rule admits anyone to port {args.port}"
            for peer in r["from"]:
                assert set(peer) == {"podSelector"}, peer  # this namespace's pods, no ipBlock
                admitted = {
                    w for w, labels in pods.items() if _selects(peer["podSelector"], labels)
                }
                assert admitted == serving, admitted
        # The metrics and probe ports stay reachable from anywhere (Prometheus, kubelet).
        for c in spec["containers"]:
            metrics_port = parsed(docs, c)[1].metrics_port
            assert any(
                not r.get("from") and _admits_port(r, metrics_port, "")
                for p in fencing
                for r in p["spec"]["ingress"]
            ), (name, c["name"], metrics_port)


ROLE_USER = {
    "services.gateway": "gateway",
    "services.admission": "admission",
    "services.conductor": "conductor",
    "services.authn": "authn",
    "services.prefill": f"worker-{FIELD_REFS['metadata.name']}",
    "services.decode": f"worker-{FIELD_REFS['metadata.name']}",
    "services.store": f"store-{FIELD_REFS['metadata.name']}",
}
SERVING = ("services.prefill", "services.decode", "services.store")


@pytest.mark.parametrize("tree", list(TREES))
def test_each_role_logs_in_as_its_own_nats_user_with_permissions(rendered, tree):
    from perigee import natsauth

    docs = rendered[tree]
    for _, c in perigee_containers(docs):
        module = c["args"][0]
        env = environment(docs, c)
        assert env["NATS_USER"] == ROLE_USER[module], module
    sts = objs(docs, "StatefulSet")["perigee-nats"]
    conf_vol = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if "configMap" in v)
    conf = objs(docs, "ConfigMap")[conf_vol["configMap"]["name"]]["data"]["nats.conf"]
    assert natsauth.k8s_authorization() in conf  # generated, not hand-kept
    # The server holds each control-plane login under the names the conf reads; serving
    # pods have none there (the callout decides them), and the callout signs with the key
    # the servers trust.
    [server] = sts["spec"]["template"]["spec"]["containers"]
    senv = environment(docs, server)
    for w, c in perigee_containers(docs):
        env = environment(docs, c)
        user = env["NATS_USER"]
        if c["args"][0] in SERVING:
            assert natsauth.env_var(user, "USER") not in senv
            token = next(
                v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "nats-token"
            )
            [src] = token["projected"]["sources"]
            mount = next(m for m in c["volumeMounts"] if m["name"] == "nats-token")
            assert (
                env["NATS_PASSWORD_FILE"]
                == f"{mount['mountPath']}/{src['serviceAccountToken']['path']}"
            )
            assert src["serviceAccountToken"]["audience"] == "perigee-nats"
            continue
        assert senv[natsauth.env_var(user, "USER")] == user
        assert senv[natsauth.env_var(user)] == env["NATS_PASSWORD"]
        if c["args"][0] == "services.authn":
            assert env["PERIGEE_AUTHN_ISSUER"] == senv[natsauth.AUTHN_ISSUER_ENV]
            _, args = parsed(docs, c)
            assert args.audience == "perigee-nats"


# -- scaling ---------------------------------------------------------------------------


@pytest.mark.parametrize("tree", list(TREES))
def test_each_role_scales_by_the_operators_tools(rendered, tree):
    docs = rendered[tree]
    deps, sts = objs(docs, "Deployment"), objs(docs, "StatefulSet")
    pdbs = objs(docs, "PodDisruptionBudget")
    # Gateways: stateless, the HPA owns the replica count.
    [hpa] = objs(docs, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "perigee-gateway",
    }
    assert "replicas" not in deps["perigee-gateway"]["spec"]
    assert (
        hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    )
    # Admission and conductors: two replicas each, kept by a PodDisruptionBudget.
    for name in ("perigee-admission", "perigee-conductor", "perigee-gateway"):
        if name != "perigee-gateway":
            assert deps[name]["spec"]["replicas"] == 2
        labels = deps[name]["spec"]["template"]["metadata"]["labels"]
        sel = pdbs[name]["spec"]["selector"]["matchLabels"]
        assert sel.items() <= labels.items() and pdbs[name]["spec"]["minAvailable"] == 1
    # Two conductors in one queue group need distinct ids: the pod name.
    _, conductor = parsed(
        docs, deps["perigee-conductor"]["spec"]["template"]["spec"]["containers"][0]
    )
    assert (
        flag(deps["perigee-conductor"]["spec"]["template"]["spec"]["containers"][0], "--id")
        == "$(POD_NAME)"
    )
    assert not conductor.pd_controller
    # The P/D controller: exactly one, in a single-replica Deployment that never overlaps.
    pd = [(w, c) for w, c in perigee_containers(docs) if "--pd-controller" in c["args"]]
    assert len(pd) == 1
    w, c = pd[0]
    assert w["kind"] == "Deployment" and w["spec"]["replicas"] == 1
    assert w["spec"]["strategy"]["type"] == "Recreate"
    assert parsed(docs, c)[0] == "services.conductor"
    # Serving nodes: a StatefulSet per role; RoleSwitch{instance} names one pod, whose
    # worker switches in place.
    for role in ("prefill", "decode"):
        s = sts[f"perigee-{role}"]
        assert s["spec"]["replicas"] >= 1
        worker = next(
            c for c in s["spec"]["template"]["spec"]["containers"] if c["name"] == "worker"
        )
        assert flag(worker, "--instance") == flag(worker, "--node") == "$(POD_NAME)"
        assert parsed(docs, worker)[1].switchable
        assert pdbs[f"perigee-{role}"]["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("tree", list(TREES))
def test_the_pd_controllers_role_switches_reach_kubernetes(rendered, tree):
    """A switched worker labels its own pod perigee.io/role (services.worker.pod_role):
    its pod runs as a service account that may patch pods and nothing else, and the
    labels file it starts from is the pod's downward API view of its labels."""
    docs = rendered[tree]
    accounts = {
        w["metadata"]["name"]: w["spec"]["template"]["spec"].get("serviceAccountName")
        for w in workloads(docs)
    }
    serving = {"perigee-prefill", "perigee-decode"}
    assert {n for n, sa in accounts.items() if sa == "perigee-worker"} == serving
    assert "perigee-worker" in objs(docs, "ServiceAccount")
    [binding] = [
        b
        for b in objs(docs, "RoleBinding").values()
        for sub in b["subjects"]
        if (sub["kind"], sub["name"], sub.get("namespace"))
        == ("ServiceAccount", "perigee-worker", "perigee")
    ]
    role = objs(docs, "Role")[binding["roleRef"]["name"]]
    assert binding["roleRef"]["kind"] == "Role"  # its own namespace only
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]
    for name in serving:
        spec = objs(docs, "StatefulSet")[name]["spec"]["template"]["spec"]
        worker = next(c for c in spec["containers"] if c["name"] == "worker")
        args = parsed(docs, worker)[1]
        assert args.switchable and args.pod_role_label
        mount = next(
            m for m in worker["volumeMounts"] if args.pod_labels_file.startswith(m["mountPath"])
        )
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        item = next(
            i
            for i in volume["downwardAPI"]["items"]
            if Path(mount["mountPath"], i["path"]) == Path(args.pod_labels_file)
        )
        assert item["fieldRef"]["fieldPath"] == "metadata.labels"


def test_kubectl_scale_would_find_the_scale_subresources(rendered):
    """kubectl scale works on Deployments and StatefulSets (their scale subresource):
    every role that scales by replica count is one of those, never a bare Pod."""
    kinds = {d["kind"] for d in rendered["base"]}
    assert "Pod" not in kinds and "ReplicaSet" not in kinds
    names = {w["metadata"]["name"]: w["kind"] for w in workloads(rendered["base"])}
    assert names == {
        "perigee-nats": "StatefulSet",
        "perigee-gateway": "Deployment",
        "perigee-admission": "Deployment",
        "perigee-conductor": "Deployment",
        "perigee-pd-controller": "Deployment",
        "perigee-prefill": "StatefulSet",
        "perigee-decode": "StatefulSet",
        "perigee-authn": "Deployment",
    }


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("tree", list(TREES))
def test_the_nats_server_refuses_a_placeholder_password(rendered, tree, tmp_path):
    """Its command checks the Secret's passwords before it starts nats-server: with
    credentials.env's template values it exits 1, with real ones it execs the server."""
    sts = objs(rendered[tree], "StatefulSet")["perigee-nats"]
    [server] = sts["spec"]["template"]["spec"]["containers"]
    assert server["command"] == ["sh", "-c"]
    [script] = server["args"]
    assert script.rstrip().endswith("exec nats-server -c /etc/nats/nats.conf")
    env = environment(rendered[tree], server)
    fake = tmp_path / "nats-server"
    fake.write_text("#!/bin/sh\necho started\n")
    fake.chmod(0o755)
    base = {"PATH": f"{tmp_path}:{os.environ['PATH']}"}
    sh = shutil.which("sh")
    assert sh
    r = subprocess.run([sh, "-c", script], env={**base, **env}, capture_output=True, text=True)
    assert r.returncode == 1 and "REPLACE-ME" in r.stderr, (r.returncode, r.stderr)
    real = {
        k: ("s3cret" if k.endswith("_NATS_PASSWORD") or k == "AUTHN_ISSUER" else v)
        for k, v in env.items()
    }
    r = subprocess.run([sh, "-c", script], env={**base, **real}, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "started", (r.returncode, r.stderr)


def test_nats_runs_with_gomaxprocs_of_its_cpu_limit(rendered):
    for docs in rendered.values():
        (c,) = objs(docs, "StatefulSet")["perigee-nats"]["spec"]["template"]["spec"]["containers"]
        ref = {e["name"]: e for e in c["env"]}["GOMAXPROCS"]["valueFrom"]["resourceFieldRef"]
        assert ref == {"containerName": "nats", "resource": "limits.cpu", "divisor": "1"}
        assert environment(docs, c)["GOMAXPROCS"] == str(c["resources"]["limits"]["cpu"])
