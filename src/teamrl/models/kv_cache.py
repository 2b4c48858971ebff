"""The name of the key/value cache in transformers' model calls and outputs.

Newer transformers releases call it ``cache`` where older ones say ``past_key_values`` (in 5.24 the old name
is a deprecated alias, to be removed in 5.40 for ``forward`` and 6.0 for ``generate``); teamrl supports
releases on both sides of the rename.
"""
from __future__ import annotations

from typing import Any

from transformers.modeling_outputs import CausalLMOutputWithPast

CACHE_ARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_arg(cache: Any) -> dict[str, Any]:
    """Keyword arguments that hand ``cache`` to a model's ``forward`` or ``generate``."""
    return {CACHE_ARG: cache}


def cache_of(output: Any) -> Any:
    """The key/value cache a model's forward pass returned."""
    return getattr(output, CACHE_ARG)
