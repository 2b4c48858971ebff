"""TL;DR two-level summaries as a program (the ``program_tldr_cpu`` preset; docs/programs.md).

Two agents, called by name through the OpenAI-compatible endpoint at ``base_url`` with the official client:

- :func:`run`, a planner -> writer pipeline: the ``planner`` writes the one-sentence summary, then the ``writer``
  reads the text *and the planner's sentence* and writes the detailed summary around it. A sequence the parallel
  ``tldr`` task cannot express (there every agent writes at once, from its own prompt).
- :func:`parallel`, the ``tldr`` task's own shape: both summaries asked at once, neither agent seeing the other's
  (benchmarks/program_gateway.py compares it with the native ``demo_tldr_cpu`` run).

Both return the TL;DR reward of (one-sentence summary, detailed summary) (:func:`teamrl.rewards.writing.tldr_reward`,
max 3.0), on the abstract cut to 500 characters, as the demo preset reads it.
"""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI, OpenAI

from teamrl.envs.writing import truncate
from teamrl.rewards.base import RewardResult
from teamrl.rewards.writing import tldr_reward

MAX_TEXT_CHARS = 500
MAX_TOKENS = 64

PLANNER = ("You write very short summaries. A teammate writes the detailed summary of the same text from yours, so "
           "you give only the main point: one plain sentence, no lists, no preamble.")
WRITER = ("You write detailed summaries. A teammate wrote the one-sentence summary below; you explain the key points, "
          "the reasons and the outcome in one paragraph, linking ideas with words such as first, because, however and "
          "finally. No lists, no preamble.")
DETAILED = ("You write detailed summaries. A teammate writes the one-sentence summary of the same text, so you explain "
            "the key points, the reasons and the outcome in one paragraph, linking ideas with words such as first, "
            "because, however and finally. No lists, no preamble.")
ONE_SENTENCE = "In one sentence of 15 to 25 words, state the main point of the text above."
IN_DETAIL = "Summarize the text above in detail: one paragraph of 3 to 4 sentences, in your own words."


def _text(item: dict) -> str:
    return truncate(item.get("text") or item["abstract"], MAX_TEXT_CHARS)


def _chat(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def run(item: dict, base_url: str) -> RewardResult:
    """The planner's sentence first, then the writer's paragraph written from the text and that sentence."""
    client = OpenAI(base_url=base_url, api_key="-", max_retries=0)
    text = _text(item)
    summary = client.chat.completions.create(
        model="planner", messages=_chat(PLANNER, f"Text:\n{text}\n\n{ONE_SENTENCE}"), max_tokens=MAX_TOKENS,
    ).choices[0].message.content
    detailed = client.chat.completions.create(
        model="writer", max_tokens=MAX_TOKENS,
        messages=_chat(WRITER, f"Text:\n{text}\n\nYour teammate's one-sentence summary:\n{summary}\n\n{IN_DETAIL}"),
    ).choices[0].message.content
    return tldr_reward(summary, detailed)


async def parallel(item: dict, base_url: str) -> RewardResult:
    """Both summaries at once, each agent from the text alone: the ``tldr`` task written as a program."""
    text = _text(item)
    # Closed here, in the episode's own event loop: left to the garbage collector, the client would close its
    # connections on a loop that has ended ("Event loop is closed").
    async with AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0) as client:
        summary, detailed = await asyncio.gather(
            client.chat.completions.create(model="planner", max_tokens=MAX_TOKENS,
                                           messages=_chat(PLANNER, f"Text:\n{text}\n\n{ONE_SENTENCE}")),
            client.chat.completions.create(model="writer", max_tokens=MAX_TOKENS,
                                           messages=_chat(DETAILED, f"Text:\n{text}\n\n{IN_DETAIL}")))
    return tldr_reward(summary.choices[0].message.content, detailed.choices[0].message.content)
