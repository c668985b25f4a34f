"""Seeded random LLaMA weights for tests and benchmarks (no hub, no download).

vLLM's ``load_format="dummy"`` fills every tensor with uniform(-1e-3, 1e-3) from a
fixed seed (1234, per tensor, independent of ``LLM(seed=...)``): identical across
processes, but so small that the model emits the same couple of tokens whatever the
context, which makes an exactness test toothless.  This writes a real
``model.safetensors`` next to a copy of the config, with scales chosen so the output
depends strongly on every KV entry (embeddings ~N(0,1), projections ~N(0, 1/fan_in)).
"""

import json
import shutil
from pathlib import Path

import numpy as np


def _tensors(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(seed))
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    hd = int(cfg.get("head_dim") or h // heads)
    vocab = int(cfg["vocab_size"])

    def lin(out: int, inp: int) -> np.ndarray:  # HF Linear weight is [out, in]
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    t = {"model.embed_tokens.weight": rng.standard_normal((vocab, h)).astype(np.float32)}
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = lin(heads * hd, h)
        t[p + "self_attn.k_proj.weight"] = lin(kv_heads * hd, h)
        t[p + "self_attn.v_proj.weight"] = lin(kv_heads * hd, h)
        t[p + "self_attn.o_proj.weight"] = lin(h, heads * hd)
        t[p + "mlp.gate_proj.weight"] = lin(inter, h)
        t[p + "mlp.up_proj.weight"] = lin(inter, h)
        t[p + "mlp.down_proj.weight"] = lin(h, inter)
        t[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    t["model.norm.weight"] = np.ones(h, np.float32)
    t["lm_head.weight"] = lin(vocab, h)
    return t


def write_random_checkpoint(model_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """Copy ``model_dir`` (config + tokenizer files) to ``out_dir`` and add seeded weights.

    Same seed -> byte-identical ``model.safetensors`` on any machine (numpy PCG64).
    """
    from safetensors.numpy import save_file  # ships with vLLM / transformers

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix in (".json", ".model", ".txt"):
            shutil.copy2(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    save_file(_tensors(cfg, seed), str(out / "model.safetensors"))
    return out
