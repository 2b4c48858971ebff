"""Was ``teamrl serve --vllm-url``'s router, now ``teamrl.serve.vllm_proxy.VLLMProxy``. Deprecated: its names moved
(issue #47); importing one from here warns and still works for one release.
"""

from teamrl._deprecated import moved_names

__getattr__ = moved_names(__name__, {
    "VLLMBackend": "teamrl.serve.vllm_proxy:VLLMProxy",
})
