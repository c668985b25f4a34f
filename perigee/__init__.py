"""perigee: KVCache-centric disaggregated LLM serving (command-line entry points)."""
