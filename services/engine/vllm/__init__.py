"""vLLM backend for perigee (``--engine vllm``). Importing this package does not import
vLLM; :mod:`.engine` imports it in its engine thread, :mod:`.connector` at load.

- :mod:`.engine` -- ``VllmEngine``: an in-process ``LLMEngine`` stepped by one thread
  behind the :class:`~services.engine.base.Engine` interface (prefill and decode);
- :mod:`.connector` -- ``PerigeeConnector``, the KVConnectorBase_V1 vLLM loads through
  ``kv_connector_module_path="services.engine.vllm.connector"``: KV pages between the
  node store's shared-memory slots and vLLM's paged cache, layer by layer;
- :mod:`.bridge` -- what the engine tells the connector per request (slots, hooks);
- :mod:`.options` -- settings, service flags and the environment vLLM needs;
- :mod:`.reference` -- plain vLLM over a prompt list in a child process (tests, benches);
- :mod:`.weights` -- seeded random LLaMA checkpoint (exactness tests, demos).

Never run a file here as a script (``python services/engine/vllm/x.py`` would shadow the
real ``vllm`` package): use ``python -m services.engine.vllm.<module>``.
"""
