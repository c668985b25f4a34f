"""What ``perigee up`` starts (:class:`StackConfig`), apart from how it starts it
(:mod:`perigee.stack`), so that :mod:`perigee.deploy_spec`, which renders every
service's command line from it, does not import the stack that starts them."""

from dataclasses import dataclass, field

from perigee.supervise import RestartPolicy
from services.common import admission_mode, defaults
from services.common.admission_mode import AdmissionMode
from services.common.model_spec import DEFAULT_MODEL_DIR
from tracing.sampler import DEFAULT_RATE as DEFAULT_TRACE_RATE


@dataclass
class StackConfig:
    """What ``perigee up`` starts: the bus, pool sizes, engine, model and each service's flags."""

    nats_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: int = 1
    decode: int = 1
    engine: str = "mock"
    model_dir: str = str(DEFAULT_MODEL_DIR)  # perigee up: the real model (perigee.models)
    served_model_name: str = ""  # the gateway's name for it ("": the directory's name)
    block_size: int = defaults.BLOCK_SIZE
    speedup: str = "1.0"
    store_capacity_blocks: int = 4096
    # Each store's SSD tier, blocks (0: none): <log_dir>/ssd/<node>, kept across restarts.
    store_ssd_blocks: int = 0
    ttft_slo: float = defaults.TTFT_SLO_S
    tbt_slo: float = defaults.TBT_SLO_S
    # Where overload is refused; every admission, conductor and worker gets it as
    # PERIGEE_ADMISSION_MODE (services.common.admission_mode).
    admission_mode: AdmissionMode = admission_mode.DEFAULT
    # Conductors conductor-0..N-1 in one queue group against the same stores (§5.3);
    # the child is named "conductor" when there is one, "conductor-<i>" otherwise.
    conductors: int = 1
    # Admission services in their queue group ("admission" when one, "admission-<i>").
    admissions: int = 1
    cost_model: str = ""  # fitted cost model JSON for admission and conductors
    balancing_threshold: str = ""  # "": the conductor's default; a number or "adaptive"
    pd_controller: bool = False  # conductor-0 runs the dynamic P/D ratio controller
    # False: the conductor rejects what misses the SLO even on an idle instance (the
    # paper's Algorithm 1); True: an idle instance takes it (PlacementPolicy).
    serve_when_idle: bool = True
    # Chunked pipeline parallelism: the conductors' --cpp-group, --cpp-chunk-tokens and
    # --cpp-min-tokens (0: their defaults).
    cpp_group: int = 1
    cpp_chunk_tokens: int = 0
    cpp_min_tokens: int = 0
    switchable: bool = False  # workers obey RoleSwitch (--switchable)
    decode_time: float = 5.0  # predict admission: uniform decode time t_d, s
    max_batch: int = 128
    dead_after: float = defaults.DEAD_AFTER_S
    migration_limit: int = 3  # gateway: resends of a request whose worker died (0: fail it)
    report_interval: float = defaults.REPORT_INTERVAL_S
    log_dir: str = ".perigee/logs"
    log_level: str = "INFO"
    # Share of requests traced, decided once at the root (the gateway) and followed by
    # every service (OpenTelemetry's parentbased_traceidratio): 1.0 traces every request
    # (perigee breakdown sees them all); 0.1 cut the stack's CPU per request by ~14 %.
    trace_sample: float = 1.0
    # With trace_sample 1.0: at most this many new traces a second at each root
    # (tracing.sampler; every request below it), 0 for every request at any load.
    trace_rate: float = DEFAULT_TRACE_RATE
    extra_env: dict[str, str] = field(default_factory=dict)
    # The tree whose services run ("": this one): `perigee bench capacity-ab` runs
    # another revision's services beside this one's, with the same flags.
    code_root: str = ""
    # More flags for every child of one service kind (gateway, admission, conductor,
    # prefill, decode, store), after the ones the stack sets: `perigee up --gateway-arg`.
    service_args: dict[str, list[str]] = field(default_factory=dict)
    api_key: str = ""  # gateway API key(s), comma list (PERIGEE_API_KEY); "": open
    metrics: bool = True  # each service serves /metrics on a free port (metrics-targets.json)
    # --engine vllm: vLLM load format ("": auto if the model directory holds weights,
    # else dummy), paged-cache blocks per engine (0: by role); and the workers'
    # store-transaction lease (0: their default; renewed while a request lives).
    load_format: str = ""
    kv_blocks: int = 0
    # --engine vllm on GPUs: the memory share of each card that its engines split
    # (0: 0.8; perigee.gpus)
    gpu_memory_utilization: float = 0.0
    tool_call_parser: str | None = None  # gateway: vLLM's tool parser for tool_choice auto
    lease_s: float = 0.0
    # Longest request (prompt + output), tokens: the gateway's limit and what each store
    # must hold (0: the model's max_position_embeddings).
    max_model_len: int = 0
    # The bus perigee starts (no nats_url): this many clustered nats-servers (JetStream
    # streams get min(3, n) replicas: PERIGEE_JS_REPLICAS), one NATS user per service
    # with subject permissions (perigee.natsauth), the server's max_payload (None: 1 MiB).
    nats_cluster: int = 1
    nats_auth: bool = True
    nats_max_payload: int | None = None
    # GOMAXPROCS of the nats-servers this stack starts: None, a quarter of the cores
    # (perigee.natsd.embedded_procs); 0, Go's default (every core).
    nats_procs: int | None = None
    # False (the services' default): requests on the core path, what a dead admission
    # or conductor held resent by the gateway from their presence beats
    # (services.gateway.control_presence). True: on the JetStream work queues
    # (services.common.intake_queue), redelivered by the streams: two stream hops and a
    # placement claim more a request.
    durable_intake: bool = False
    # Once ready, restart a service that dies (perigee up; perigee.supervise). Off for
    # tests that assert no service died (Stack.exited()).
    supervise: bool = False
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
