"""``perigee render compose|k8s``: write the perigee services' command lines into
compose.yaml and the Kubernetes manifests under deploy/k8s/base from perigee.deploy_spec,
the source ``perigee up`` starts its children from too.

Only the command lines are rendered (compose's ``command:``, a container's ``args:``);
everything around them (ports, probes, resources, comments) stays as written. A
perigee service in a file that deploy_spec does not describe, or one it describes that
the file lacks, is an error: add or remove its block by hand, then render.
``--check`` writes nothing and exits 1 if a file differs from what it would write
(tests/unit/perigee/test_render.py does the same)."""

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

from perigee import deploy_spec

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "compose.yaml"
K8S_BASE = ROOT / "deploy" / "k8s" / "base"
WIDTH = 100


class RenderError(Exception):
    """A file and deploy_spec do not describe the same services."""


# -- compose.yaml ----------------------------------------------------------------------


def _anchors(text: str) -> dict[str, str]:
    """The header's anchored scalars (``x-...: &name "value"``), value -> ``*name``."""
    return {
        json.loads(m.group(2)): f"*{m.group(1)}"
        for m in re.finditer(r'^x-[\w-]+: &(\w+) ("(?:[^"\\]|\\.)*")$', text, re.M)
    }


def _flow(tokens: list[str], indent: int, first: str) -> list[str]:
    """A YAML flow sequence of ``tokens`` after ``first`` (``    command: [``), wrapped at
    :data:`WIDTH` with continuation lines aligned after the bracket."""
    lines, line = [], first
    for i, tok in enumerate(tokens):
        piece = tok + ("]" if i == len(tokens) - 1 else ",")
        if line != first and len(line) + 1 + len(piece) > WIDTH:
            lines.append(line)
            line = " " * indent + piece
        else:
            line += ("" if line == first else " ") + piece
    return [*lines, line]


def render_compose(text: str, services: dict[str, deploy_spec.ServiceCmd] | None = None) -> str:
    """``text`` (compose.yaml) with each perigee service's ``command:`` rendered."""
    services = deploy_spec.compose() if services is None else services
    aliases = _anchors(text)
    lines = text.split("\n")
    perigee = {
        name
        for name, s in (yaml.safe_load(text).get("services") or {}).items()
        if s.get("image") == "perigee:latest"
        or str(s.get("command", [""])[0]).startswith("services.")
    }
    if missing := sorted(perigee ^ set(services)):
        raise RenderError(
            f"compose.yaml and perigee.deploy_spec.compose() differ in services {missing}: "
            "add or remove the block by hand"
        )
    out: list[str] = []
    service = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if m := re.match(r"^  ([\w-]+):(\s|$)", line):
            service = m.group(1)
        if service in services and (m := re.match(r"^(\s+)command: \[", line)):
            end = i
            while not lines[end].rstrip().endswith("]"):
                end += 1
            argv = services[service].manifest_argv()
            tokens = [aliases.get(t, json.dumps(t)) for t in argv]
            first = f"{m.group(1)}command: ["
            out += _flow(tokens, len(first), first)
            i = end + 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


# -- deploy/k8s ------------------------------------------------------------------------


def _scalar(tok: str) -> str:
    """A plain YAML scalar where it reads back as the same string, else quoted."""
    try:
        plain = yaml.safe_load(tok) == tok and " #" not in tok
    except yaml.YAMLError:
        plain = False
    return tok if plain else json.dumps(tok)


def render_k8s(
    text: str,
    containers: dict[tuple[str, str], deploy_spec.Container],
    seen: set[tuple[str, str]],
) -> str:
    """``text`` (one manifest file) with each perigee container's ``args:`` rendered;
    the (workload, container) keys it held are added to ``seen``."""
    lines = text.split("\n")
    out: list[str] = []
    workload = ""
    container: tuple[str, int] | None = None  # its name and the indent of its fields
    i = 0
    while i < len(lines):
        line = lines[i]
        if line == "---":
            workload, container = "", None
        elif not workload and (m := re.match(r"^  name: (\S+)", line)):
            workload = m.group(1)
        elif m := re.match(r"^(\s+)- name: (\S+)$", line):
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            image = re.match(rf"^{m.group(1)}  image: perigee(:\S+)?$", nxt)
            container = (m.group(2), len(m.group(1)) + 2) if image else None
        elif container and (m := re.match(rf"^{' ' * container[1]}args:$", line)):
            key = (workload, container[0])
            if key not in containers:
                raise RenderError(f"{key}: a perigee container perigee.deploy_spec.k8s() lacks")
            seen.add(key)
            out.append(line)
            item = " " * (container[1] + 2) + "- "
            i += 1
            while i < len(lines) and lines[i].startswith(item):
                i += 1
            c = containers[key]
            argv = c.service.manifest_argv()
            for tok in argv:
                note = c.notes.get(tok.split("=", 1)[0]) if tok.startswith("--") else None
                out.append(item + _scalar(tok) + (f"  # {note}" if note else ""))
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def k8s_files() -> list[Path]:
    return sorted(K8S_BASE.glob("*.yaml"))


def render_all_k8s() -> dict[Path, str]:
    """Each manifest file of deploy/k8s/base as rendered (RenderError if a container
    deploy_spec describes is in none of them)."""
    containers = deploy_spec.k8s()
    seen: set[tuple[str, str]] = set()
    out = {f: render_k8s(f.read_text(), containers, seen) for f in k8s_files()}
    if missing := sorted(set(containers) - seen):
        raise RenderError(f"no container in deploy/k8s/base for {missing}: add its block by hand")
    return out


def rendered(what: str) -> dict[Path, str]:
    """File -> its rendered text, for ``compose`` or ``k8s``."""
    if what == "compose":
        return {COMPOSE_FILE: render_compose(COMPOSE_FILE.read_text())}
    return render_all_k8s()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="perigee render", description=__doc__)
    p.add_argument("what", choices=["compose", "k8s"])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    a = p.parse_args(argv)
    try:
        files = rendered(a.what)
    except RenderError as e:
        print(f"perigee render: {e}", file=sys.stderr)
        return 2
    stale = [f for f, text in files.items() if f.read_text() != text]
    for f in stale:
        rel = f.relative_to(ROOT)
        if a.check:
            print(f"{rel}: differs from perigee.deploy_spec", file=sys.stderr)
        else:
            f.write_text(files[f])
            print(f"perigee render: wrote {rel}")
    return 1 if a.check and stale else 0
