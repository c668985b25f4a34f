"""What the serving path needs to know about a model: the shape of its KV cache.

Read from a HuggingFace LLaMA-style ``config.json`` (and ``generation_config.json``'s
EOS ids); the store and transfer path size blocks from it, the mock engine emits KV of
exactly this size.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float": 4, "half": 2}

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"


@dataclass(frozen=True)
class ModelSpec:
    """A model's KV shape and stop tokens, as the serving path needs them."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    dtype: str = "float32"
    eos_token_id: int | None = None  # the engines stop on it unless ignore_eos
    # Every end-of-sequence id the model declares (config.json, generation_config.json):
    # a chat model may end a turn on any of them.
    eos_token_ids: tuple[int, ...] = ()

    @property
    def elem_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.elem_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_bytes_per_token_layer

    def block_bytes(self, block_size: int) -> int:
        return block_size * self.kv_bytes_per_token

    def layer_block_bytes(self, block_size: int) -> int:
        return block_size * self.kv_bytes_per_token_layer

    @classmethod
    def from_config(
        cls, cfg: dict[str, Any], name: str = "", dtype: str | None = None
    ) -> "ModelSpec":
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos_ids = _ids(cfg.get("eos_token_id"))
        return cls(
            name=name or cfg.get("_name_or_path") or "perigee-model",
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            max_model_len=int(cfg.get("max_position_embeddings", 4096)),
            dtype=dtype or str(cfg.get("torch_dtype", "float32")),
            eos_token_id=eos_ids[0] if eos_ids else None,
            eos_token_ids=tuple(eos_ids),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path | None = None, dtype: str | None = None) -> "ModelSpec":
        path = Path(model_dir) if model_dir else DEFAULT_MODEL_DIR
        cfg = json.loads((path / "config.json").read_text())
        gen_path = path / "generation_config.json"
        if gen_path.exists():  # its EOS ids join config.json's, which come first
            extra = _ids(json.loads(gen_path.read_text()).get("eos_token_id"))
            ids = _ids(cfg.get("eos_token_id"))
            cfg = {**cfg, "eos_token_id": ids + [i for i in extra if i not in ids]}
        return cls.from_config(cfg, name=path.name, dtype=dtype)


def _ids(v: int | list[int] | None) -> list[int]:
    if v is None:
        return []
    return [int(i) for i in v] if isinstance(v, list) else [int(v)]
