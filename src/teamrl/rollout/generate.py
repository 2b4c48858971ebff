"""Batched sampling with transformers, and the log-probs of completions under a policy.

One ``generate`` call per agent per turn covers every observation x G samples. A completion's loss
mask covers its tokens up to and including the first end-of-sequence token: prompt tokens, padding and
whatever follows EOS never enter the loss. Masks come from explicit lengths, never from looking for pad
or EOS inside the prompt (chat templates end every turn with the EOS token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from teamrl.team import Agent


@dataclass
class Generation:
    """An agent's completions for a batch of prompts, ``num_samples`` consecutive rows per prompt."""

    prompt_ids: torch.Tensor
    """(B, P) left-padded prompt token ids."""
    prompt_mask: torch.Tensor
    """(B, P) 1 on real prompt tokens."""
    completion_ids: torch.Tensor
    """(B, C) sampled token ids (positions after the completion's end hold padding)."""
    completion_mask: torch.Tensor
    """(B, C) 1 on tokens up to and including the first EOS: exactly the tokens that are trained."""
    sampling_logprobs: torch.Tensor
    """(B, C) log-prob of each sampled token under the temperature-scaled policy that sampled it (0 where masked)."""
    texts: list[str]
    """Decoded completions (special tokens dropped)."""

    @property
    def num_tokens(self) -> int:
        """Generated tokens that count (EOS included)."""
        return int(self.completion_mask.sum())


def completion_mask(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 on every token up to and including the first EOS of each row (every token if there is none)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    # A token is kept while no EOS came strictly before it.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (eos_before == 0).long()


@torch.no_grad()
def generate(agent: Agent, prompts: list[str], num_samples: int, adapter_names: list[str] | None = None) -> Generation:
    """Sample ``num_samples`` completions for every prompt in one batched ``generate`` call.

    ``adapter_names`` (one per prompt) runs several LoRA agents that share ``agent``'s base in the
    same batch, each row through its own adapter (PEFT mixed-adapter batches); ``agent`` then only
    supplies the tokenizer and sampling settings.
    """
    tokenizer = agent.tokenizer
    tokenizer.padding_side = "left"
    # A chat template already places the special tokens; plain text gets the tokenizer's own (e.g. BOS).
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not agent.uses_chat_template)
    device = next(agent.model.parameters()).device
    prompt_ids = encoded["input_ids"].to(device)
    prompt_mask = encoded["attention_mask"].to(device)
    sampling = agent.sampling
    recorder = _SampledLogprobs(sampling.temperature)
    extra = {}
    if adapter_names is not None:
        extra["adapter_names"] = [name for name in adapter_names for _ in range(num_samples)]
    else:
        agent.activate()
    agent.model.eval()
    out = agent.model.generate(
        **extra,
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_new_tokens=sampling.max_new_tokens,
        num_return_sequences=num_samples,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=agent.eos_token_ids,
        logits_processor=LogitsProcessorList([recorder]),
    )
    completion_ids = out[:, prompt_ids.shape[1]:]
    mask = completion_mask(completion_ids, agent.eos_token_ids)
    logprobs = recorder.finish(out[:, -1]) * mask
    texts = tokenizer.batch_decode(completion_ids * mask + tokenizer.pad_token_id * (1 - mask),
                                   skip_special_tokens=True)
    return Generation(
        prompt_ids=prompt_ids.repeat_interleave(num_samples, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(num_samples, dim=0),
        completion_ids=completion_ids,
        completion_mask=mask,
        sampling_logprobs=logprobs,
        texts=[t.strip() for t in texts],
    )


class _SampledLogprobs(LogitsProcessor):
    """Records the log-prob of each sampled token while ``generate`` runs, holding one step of logits at a time.

    transformers runs user processors before its temperature/top-k/top-p warpers, so ``scores`` are the
    model's logits; a step's sampled token is only known at the next call (or from the final sequences).
    Keeping all steps' logits instead (``output_logits``) would cost B x C x vocabulary floats.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.logprobs: list[torch.Tensor] = []
        self._pending: torch.Tensor | None = None

    def _record(self, tokens: torch.Tensor) -> None:
        if self._pending is not None:
            self.logprobs.append(self._pending.gather(1, tokens.unsqueeze(1)).squeeze(1))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._record(input_ids[:, -1])
        self._pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """(B, C) log-probs, given the last sampled token of every row."""
        self._record(last_tokens)
        self._pending = None
        return torch.stack(self.logprobs, dim=1)


def token_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """(B, C) log-prob of each completion token under ``model`` (temperature-scaled), in one forward pass.

    Masked completion tokens are excluded from attention, and positions are counted over real tokens
    only, so the numbers match what the model computed while sampling with left padding.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    num_completion = completion_ids.shape[1]
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=num_completion + 1,
    ).logits[:, :-1].float() / temperature
    sampled = torch.gather(logits, 2, completion_ids.unsqueeze(-1)).squeeze(-1)
    return sampled - torch.logsumexp(logits, dim=-1)
