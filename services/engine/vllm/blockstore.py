"""Prototype block store for the vLLM connector: one file per block in a directory.

Stand-in for the perigee store (services/store) until the connector talks to a
StoreClient: keys are strings (``"%016x" % block_hash`` for full prompt blocks,
``"tail-<id>"`` for a request's partial tail), a value is ``block_bytes`` laid out
layer-major (``[layer 0 | layer 1 | ...]``, each layer span = the engine's own bytes for
those tokens).  Writes go to a temp file then ``os.replace`` so a reader in another
process sees a block whole or not at all.  Put ``root`` under /dev/shm to stay in RAM.
"""

import os
from pathlib import Path


class DirBlockStore:
    def __init__(self, root: str | Path, block_bytes: int | None) -> None:
        """``block_bytes`` None: lookups only (the scheduler side never reads bytes)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes

    def _path(self, key: str) -> Path:
        if "/" in key or key.startswith("."):
            raise ValueError(f"bad block key {key!r}")
        return self.root / key

    def has(self, key: str) -> bool:
        return self._path(key).exists()

    def longest_prefix(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first, are present."""
        n = 0
        for k in keys:
            if not self.has(k):
                break
            n += 1
        return n

    def read(self, key: str) -> bytearray | None:
        try:
            data = bytearray(self._path(key).read_bytes())
        except FileNotFoundError:
            return None
        if self.block_bytes is not None and len(data) != self.block_bytes:
            raise ValueError(f"block {key} has {len(data)} bytes, want {self.block_bytes}")
        return data

    def write(self, key: str, data: bytes | bytearray | memoryview) -> None:
        if self.block_bytes is not None and len(data) != self.block_bytes:
            raise ValueError(f"block {key}: {len(data)} bytes, want {self.block_bytes}")
        path = self._path(key)
        tmp = path.with_name(f".{key}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
