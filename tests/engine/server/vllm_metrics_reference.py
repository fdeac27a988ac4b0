"""vLLM's Prometheus metrics as its server exports them: name, type, label names.

Taken from vLLM's ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``, vLLM main, 2026) and its
production-metrics page (docs.vllm.ai/en/stable/usage/metrics/).  Every metric there is labelled with
``model_name`` and ``engine`` (the engine's index among data-parallel engines); prometheus_client
exports a counter ``X`` as ``X_total``.  Metrics that exist only with a feature m3stack does not have
(LoRA, speculative decoding, KV connectors, sleep mode, NaN checks, KV-block residency sampling) are
listed as well, so an m3stack metric under a vLLM name can never disagree with vLLM's definition.
"""

BASE = ("model_name", "engine")

# name (as exported) -> (type, label names)
VLLM_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm:num_requests_running": ("gauge", BASE),
    "vllm:num_requests_waiting": ("gauge", BASE),
    "vllm:engine_sleep_state": ("gauge", (*BASE, "sleep_state")),
    "vllm:kv_cache_usage_perc": ("gauge", BASE),
    "vllm:corrupted_requests": ("counter", BASE),
    "vllm:prefix_cache_queries": ("counter", BASE),
    "vllm:prefix_cache_hits": ("counter", BASE),
    "vllm:external_prefix_cache_queries": ("counter", BASE),
    "vllm:external_prefix_cache_hits": ("counter", BASE),
    "vllm:mm_cache_queries": ("counter", BASE),
    "vllm:mm_cache_hits": ("counter", BASE),
    "vllm:num_preemptions": ("counter", BASE),
    "vllm:prompt_tokens": ("counter", BASE),
    "vllm:prompt_tokens_by_source": ("counter", (*BASE, "source")),
    "vllm:prompt_tokens_cached": ("counter", BASE),
    "vllm:prompt_tokens_recomputed": ("counter", BASE),
    "vllm:generation_tokens": ("counter", BASE),
    "vllm:request_success": ("counter", (*BASE, "finished_reason")),
    "vllm:request_prompt_tokens": ("histogram", BASE),
    "vllm:request_generation_tokens": ("histogram", BASE),
    "vllm:iteration_tokens_total": ("histogram", BASE),
    "vllm:request_max_num_generation_tokens": ("histogram", BASE),
    "vllm:request_params_n": ("histogram", BASE),
    "vllm:request_params_max_tokens": ("histogram", BASE),
    "vllm:time_to_first_token_seconds": ("histogram", BASE),
    "vllm:inter_token_latency_seconds": ("histogram", BASE),
    "vllm:request_time_per_output_token_seconds": ("histogram", BASE),
    "vllm:e2e_request_latency_seconds": ("histogram", BASE),
    "vllm:request_queue_time_seconds": ("histogram", BASE),
    "vllm:request_inference_time_seconds": ("histogram", BASE),
    "vllm:request_prefill_time_seconds": ("histogram", BASE),
    "vllm:request_decode_time_seconds": ("histogram", BASE),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", BASE),
    "vllm:kv_block_lifetime_seconds": ("histogram", BASE),
    "vllm:kv_block_idle_before_evict_seconds": ("histogram", BASE),
    "vllm:kv_block_reuse_gap_seconds": ("histogram", BASE),
    "vllm:lora_requests_info": ("gauge", ("max_lora", "waiting_lora_adapters", "running_lora_adapters")),
    "vllm:spec_decode_num_drafts": ("counter", BASE),
    "vllm:spec_decode_num_draft_tokens": ("counter", BASE),
    "vllm:spec_decode_num_accepted_tokens": ("counter", BASE),
}

# What issue 31 asks every m3stack engine to export: requests running and waiting, KV cache usage, prefix cache
# queries and hits, prompt and generation tokens, TTFT, inter-token latency, end-to-end latency, queue, prefill and
# decode time, preemptions, request success by finish reason.
REQUIRED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:num_preemptions",
    "vllm:request_success",
)
# vLLM's finished_reason values (str(FinishReason)).
FINISHED_REASONS = ("stop", "length", "abort", "error")
