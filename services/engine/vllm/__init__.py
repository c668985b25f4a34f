"""vLLM backend for perigee (issue 3): KV connector + helpers. Imports vLLM lazily.

- :mod:`.connector` -- ``PerigeeConnector``, a vLLM KVConnectorBase_V1 loaded through
  ``kv_connector_module_path="services.engine.vllm.connector"`` (imports vLLM);
- :mod:`.blockstore` -- prototype on-host block store (one file per block);
- :mod:`.weights` -- seeded random LLaMA checkpoint for exactness tests.
"""
