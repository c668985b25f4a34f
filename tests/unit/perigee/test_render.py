"""compose.yaml's and deploy/k8s's command lines are what perigee.deploy_spec renders (the
source perigee up's children come from too), so a hand edit of one fails here; and
the renderer finds every perigee service in the files and nothing else."""

import dataclasses
import importlib
import re

import pytest

from perigee import deploy_spec, render
from perigee.render import RenderError

HOW = "regenerate with `perigee render {}` (the command lines come from perigee/deploy_spec.py)"


def test_compose_yaml_is_what_the_renderer_writes():
    text = render.COMPOSE_FILE.read_text()
    assert render.render_compose(text) == text, HOW.format("compose")


def test_the_k8s_manifests_are_what_the_renderer_writes():
    files = render.render_all_k8s()
    assert files, "no manifest in deploy/k8s/base"
    for f, text in files.items():
        assert f.read_text() == text, f"{f.name}: " + HOW.format("k8s")


def test_a_hand_edited_command_line_differs_from_the_rendered_one():
    text = render.COMPOSE_FILE.read_text()
    edited = text.replace('"--node=p0"', '"--node=p9"', 1)
    assert edited != text and render.render_compose(edited) == text
    serving = render.K8S_BASE / "serving.yaml"
    text = serving.read_text()
    edited = text.replace("            - --pod-role-label\n", "", 1)
    assert edited != text
    assert render.render_k8s(edited, deploy_spec.k8s(), set()) == text


def test_a_changed_spec_changes_the_files():
    """The renderer writes what the spec says, here a store's capacity."""
    services = deploy_spec.compose()
    store = services["store-p0"]
    assert isinstance(store, deploy_spec.StoreCmd)
    services["store-p0"] = dataclasses.replace(store, capacity_blocks=8)
    out = render.render_compose(render.COMPOSE_FILE.read_text(), services)
    block = out.split("\n  store-p0:")[1].split("\n  store-d0:")[0]
    assert '"--capacity-blocks=8"' in block
    assert '"--capacity-blocks=8"' not in out.split("\n  store-d0:")[1]


def test_a_service_on_one_side_only_is_an_error():
    services = deploy_spec.compose()
    del services["admission"]
    with pytest.raises(RenderError, match="admission"):
        render.render_compose(render.COMPOSE_FILE.read_text(), services)
    containers = deploy_spec.k8s()
    del containers[("perigee-authn", "authn")]
    with pytest.raises(RenderError, match="perigee-authn"):
        render.render_k8s((render.K8S_BASE / "authn.yaml").read_text(), containers, set())


def test_compose_uses_the_headers_anchors_for_the_bus_and_metrics_flags():
    text = render.COMPOSE_FILE.read_text()
    commands = re.findall(r"command: \[\"services\.[^]]*\]", text)
    assert len(commands) == len(deploy_spec.compose())
    assert all("*nats_arg" in c and "--nats=" not in c for c in commands)


def test_every_compose_command_line_parses_with_its_services_own_parser():
    """(deploy/k8s's, with $(VAR) expanded: tests/unit/perigee/test_k8s_manifests.py.)"""
    for name, svc in deploy_spec.compose().items():
        module, *argv = svc.manifest_argv()
        ns = importlib.import_module(f"{module}.__main__").parse_args(argv)
        assert ns.nats == deploy_spec.COMPOSE_NATS, name
        assert ns.block_size == deploy_spec.COMPOSE_BLOCK_SIZE, name


def test_the_cli_checks_and_writes(tmp_path, monkeypatch, capsys):
    copy = tmp_path / "compose.yaml"
    copy.write_text(render.COMPOSE_FILE.read_text().replace('"--node=d0"', '"--node=dx"'))
    monkeypatch.setattr(render, "COMPOSE_FILE", copy)
    monkeypatch.setattr(render, "ROOT", tmp_path)
    assert render.main(["compose", "--check"]) == 1
    assert "compose.yaml: differs" in capsys.readouterr().err
    assert render.main(["compose"]) == 0
    assert '"--node=d0"' in copy.read_text() and '"--node=dx"' not in copy.read_text()
    assert render.main(["compose", "--check"]) == 0
