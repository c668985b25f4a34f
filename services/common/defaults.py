"""One home for the defaults several services and tools share; argparse and the config
dataclasses read them here instead of repeating the numbers."""

# Tokens per KV block. vLLM-CPU needs a multiple of 32; the Mooncake trace hashes 512.
BLOCK_SIZE = 32
# The paper's SLOs (§7: TTFT 30 s for long-context chat, TBT 0.1 s). The local CPU stack
# overrides them for its small model (perigee.stack.default_slos).
TTFT_SLO_S = 30.0
TBT_SLO_S = 0.1
