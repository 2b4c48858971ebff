"""What a model's chat template decides: how a prompt is rendered, and which token ends the model's turn.

Two things a tokenizer's configuration does not say outright, both read from the chat template itself:

- **where a turn ends.** A tokenizer's ``eos_token`` (and the generation config's ``eos_token_id``) is often not
  the token that closes an assistant turn: Qwen2.5-Coder-3B, a base model, names ``<|endoftext|>`` (151643)
  while its template ends every turn with ``<|im_end|>`` (151645), so a sampler stopping at EOS alone runs on
  past the answer into made-up turns. :func:`end_of_turn_ids` renders a one-exchange conversation and reads
  the special token that closes the assistant's part; :func:`stop_token_ids` adds it to the configured ones.
- **template options.** Qwen3's template thinks by default (it opens a ``<think>`` block the completion has to
  fill before answering); ``enable_thinking=False`` renders an empty one instead. :func:`render_chat` passes
  the agent's options to the template, so training, evaluation, serving and the exported cards render the
  same prompt (docs/training.md#chat-template-options).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

#: Assistant text no template contains, to find where the assistant's part ends.
_PROBE = "teamrl-end-of-turn-probe"

_turn_ends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def render_chat(tokenizer: Any, messages: Sequence[dict[str, str]], enable_thinking: bool | None) -> str:
    """``messages`` through ``tokenizer``'s chat template, with the generation prompt added.

    ``enable_thinking`` is handed to the template (templates that do not know it ignore it); None leaves the
    template's own default (what a team saved before the option existed was trained with)."""
    options = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True, **options)


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The special token that closes an assistant turn in ``tokenizer``'s chat template (as a one-item list), or
    none where it has no template, the template fails on a plain user/assistant exchange, or no special token
    follows the assistant's text (only whitespace may come between)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return []
    cached = _turn_ends.get(tokenizer)
    if cached is not None and cached[0] == template:
        return list(cached[1])
    found: tuple[int, ...] = ()
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello."},
                                              {"role": "assistant", "content": _PROBE}], tokenize=False)
    except Exception:  # a template with rules of its own (roles, tools): the configured end tokens must do
        text = ""
    if isinstance(text, str) and _PROBE in text:
        tail = text.split(_PROBE, 1)[1]
        special = set(tokenizer.all_special_ids) | {
            index for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
        for index in tokenizer.encode(tail, add_special_tokens=False):
            if index in special:
                found = (index,)
                break
            if tokenizer.decode([index]).strip():  # text before any special token: the turn has no end token
                break
    _turn_ends[tokenizer] = (template, found)
    return list(found)


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Every token id a completion ends at: the tokenizer's eos, the generation config's ``eos_token_id`` (one id
    or a list) and the chat template's end of turn (:func:`end_of_turn_ids`), sorted."""
    configured = getattr(generation_config, "eos_token_id", None)
    ids = {getattr(tokenizer, "eos_token_id", None), *(configured if isinstance(configured, list) else [configured])}
    ids.update(end_of_turn_ids(tokenizer))
    return sorted(i for i in ids if i is not None)
