"""Was vLLM rollouts: the sampler is ``teamrl.rollout.vllm_sampler``, the backend ``teamrl.backends.vllm``. Deprecated:
its names moved (issue #47); importing one from here warns and still works for one release.
"""

from teamrl._deprecated import moved_names

__getattr__ = moved_names(__name__, {
    "CompletionLike": "teamrl.rollout.vllm_sampler:CompletionLike",
    "RequestOutputLike": "teamrl.rollout.vllm_sampler:RequestOutputLike",
    "generation_from_outputs": "teamrl.rollout.vllm_sampler:generation_from_outputs",
    "export_model": "teamrl.rollout.vllm_sampler:export_model",
    "weights_version": "teamrl.rollout.vllm_sampler:weights_version",
    "vllm_lora_rank": "teamrl.rollout.vllm_sampler:vllm_lora_rank",
    "engine_memory_share": "teamrl.rollout.vllm_sampler:engine_memory_share",
    "engine_kwargs": "teamrl.rollout.vllm_sampler:engine_kwargs",
    "sampling_kwargs": "teamrl.rollout.vllm_sampler:sampling_kwargs",
    "lora_request_kwargs": "teamrl.rollout.vllm_sampler:lora_request_kwargs",
    "VLLMSampler": "teamrl.rollout.vllm_sampler:VLLMSampler",
    "VLLMBackend": "teamrl.backends.vllm:VLLMBackend",
})
