"""``teamrl serve``: a saved team behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

* :mod:`teamrl.serve.engine`: the loaded team (:class:`~teamrl.serve.engine.ServedTeam`: requests' inputs
  become each agent's observation through the task, outputs are joined as the task names them) and the
  batcher (:class:`~teamrl.serve.engine.Batcher`: one thread runs the models; requests arriving within a
  short window share one ``generate`` call per base model), or :class:`~teamrl.serve.engine.ContinuousServer`
  (continuous batching: a request joins the rows decoding at the next step).
* :mod:`teamrl.serve.app`: the routes (``/v1/models``, ``/v1/chat/completions`` with streaming,
  ``/v1/completions``, ``/health``, ``/metrics``; per-episode routes for a program's training), API keys, body limits
  and OpenAI's error shape; :func:`~teamrl.serve.app.create_app`.
* :mod:`teamrl.serve.gateway`: the app inside a training process, the endpoint a program task's episodes call.
* :mod:`teamrl.serve.vllm_proxy`: ``--vllm-url``, the batcher's stand-in that sends each agent's prompt to
  a vLLM server (one LoRA adapter per agent) instead of generating in-process.
* :mod:`teamrl.serve.metrics`: request, latency, token and batching counters.

docs/serving.md, "Serve", describes the API and what was measured. Importing this package imports
neither torch nor FastAPI; its modules do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from teamrl.serve.app import create_app as create_app
    from teamrl.serve.app import serve as serve


def __getattr__(name: str) -> Any:
    if name in ("create_app", "serve"):
        from teamrl.serve import app

        return getattr(app, name)
    raise AttributeError(f"module 'teamrl.serve' has no attribute {name!r}")
