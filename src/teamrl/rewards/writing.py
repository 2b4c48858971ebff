"""The joint rewards of the paper's two writing tasks: TLDR summarisation and arXiv expansion.

Both rewards take agent 1's completion ``c1`` and agent 2's completion ``c2`` and score four
*gated* levels in order; a failed level stops scoring. ``RewardResult.parts`` has one entry per
level reached:

* ``"length"``: level 1, 0.5 if both completions have a whitespace-token count within the task's
  inclusive bounds;
* ``"ratio"``: level 2, ``1.0 * band(rho)`` with ``rho = len(c2) / len(c1)`` in characters;
* ``"unique_words"``: level 3, ``0.5 * band(u)`` with ``u = |U(c2)| / |U(c1)|``, the number of
  distinct words of c2 over that of c1 (stopwords included);
* ``"transitions"`` = ``0.4 * T`` and ``"jaccard"`` = ``0.6 * J``: level 4, which cannot fail.
  ``T = min(1, 0.4 + 0.05 * (k - 1))`` for k >= 1 transition categories, 0 for k = 0;
  ``J = min(jaccard, cap) / cap`` with the content-word (stopword-free) Jaccard of c1 and c2.

The level that fails is recorded as 0.0 and the levels after it are absent. A level scoring 0.0 on
the closed edge of its band (e.g. TLDR ``rho == 1.1``) *passes*: the next level is still scored.
``total`` is the sum of ``parts``; the maximum is 0.5 + 1.0 + 0.5 + 1.0 = 3.0 for both tasks.
Tokens, words, unique words, stopwords and transition categories are defined in
:mod:`teamrl.rewards.text`.

**Individual rewards** (:func:`individual_writing_reward`; the independent-learner baseline,
``algorithm.learners=individual``) score one agent's completion ``c`` alone, from the joint reward's
parts that depend on that agent alone, on the same scale, gated in the same order:

* ``"length"``: 0.5 if ``c`` has a whitespace-token count within the task's bounds (level 1's test
  of this agent's completion), else 0.0 and stop;
* ``"unique_words"``: ``0.5 * |U(c)| / (words of c)``, the share of its words that are distinct.
  Level 3 measures vocabulary by the ratio of the two agents' unique words; alone, an agent's only
  reference is its own word count;
* ``"transitions"`` = ``0.4 * T`` over the transition categories found in ``c``, for an agent whose
  text the joint level 4 searches (TLDR: the detailed summary only; arXiv: both).

Level 2 (the length ratio) and the Jaccard term relate the two completions and have no individual
counterpart. Maxima: TLDR agent 0 1.0, agent 1 1.4; arXiv 1.4 each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from teamrl.rewards.base import RewardResult
from teamrl.rewards.text import (
    char_length_ratio,
    content_jaccard,
    distinct_word_share,
    token_count,
    transition_categories,
    unique_word_ratio,
)

#: Reward for passing the token-count gate (level 1).
LENGTH_REWARD = 0.5
#: Maximum of the length-ratio level (level 2).
RATIO_REWARD = 1.0
#: Maximum of the unique-word level (level 3).
UNIQUE_WORDS_REWARD = 0.5
#: Weights of the transition term T and the Jaccard term J in level 4 (whose maximum is their sum).
TRANSITION_WEIGHT = 0.4
JACCARD_WEIGHT = 0.6
#: Transition term: ``T = min(1, TRANSITION_BASE + TRANSITION_STEP * (k - 1))`` for k >= 1, so it
#: saturates at k = 13 categories (:data:`teamrl.rewards.text.TRANSITION_CATEGORIES` has 14).
TRANSITION_BASE = 0.4
TRANSITION_STEP = 0.05

#: Highest total either writing reward can give.
WRITING_MAX_REWARD = (
    LENGTH_REWARD + RATIO_REWARD + UNIQUE_WORDS_REWARD + TRANSITION_WEIGHT + JACCARD_WEIGHT
)


@dataclass(frozen=True)
class Band:
    """A trapezoid acceptance band over a ratio x: ``score(x)`` is in [0, 1] or None (reject).

    1.0 on ``[full_low, full_high]``; ``(x - zero_low) / (full_low - zero_low)`` on
    ``[zero_low, full_low)``; ``1 - (x - full_high) / (zero_high - full_high)`` on
    ``(full_high, zero_high]``; None outside ``[zero_low, zero_high]``. Infinite ``full_high`` and
    ``zero_high`` make a band with no upper limit.
    """

    zero_low: float
    full_low: float
    full_high: float
    zero_high: float

    def score(self, x: float) -> float | None:
        """The band's value at ``x`` (see the class docstring), None when ``x`` is rejected."""
        if self.full_low <= x <= self.full_high:
            return 1.0
        if self.zero_low <= x < self.full_low:
            return (x - self.zero_low) / (self.full_low - self.zero_low)
        if self.full_high < x <= self.zero_high:
            return 1.0 - (x - self.full_high) / (self.zero_high - self.full_high)
        return None


@dataclass(frozen=True)
class WritingRewardSpec:
    """The parameters that tell one gated writing reward from another.

    ``token_bounds``: inclusive whitespace-token bounds for each completion (level 1).
    ``ratio_band``: band over ``rho = len(c2) / len(c1)`` (level 2).
    ``unique_words_band``: band over ``u = |U(c2)| / |U(c1)|`` (level 3).
    ``transitions_over_both``: count transition categories over c1 and c2 together (the union of
    the categories found in each) rather than in c2 only (level 4); for the individual rewards, whether
    agent 0's transitions count as well as agent 1's.
    ``jaccard_cap``: content-word Jaccard at which J saturates to 1 (level 4).
    """

    token_bounds: tuple[int, int]
    ratio_band: Band
    unique_words_band: Band
    transitions_over_both: bool
    jaccard_cap: float


#: TLDR: concise summary (c1) and detailed summary (c2) of a Reddit post.
TLDR_SPEC = WritingRewardSpec(
    token_bounds=(8, 256),
    ratio_band=Band(1.1, 1.6, 3.2, 5.0),
    unique_words_band=Band(1.3, 2.0, math.inf, math.inf),
    transitions_over_both=False,
    jaccard_cap=0.03,
)

#: arXiv expansion: background & motivation (c1) and methods & implications (c2) from an abstract.
ARXIV_SPEC = WritingRewardSpec(
    token_bounds=(128, 256),
    ratio_band=Band(0.8, 1.3, 1.6, 2.0),
    unique_words_band=Band(0.5, 0.7, 1.3, 1.7),
    transitions_over_both=True,
    jaccard_cap=0.23,
)


def transition_score(k: int) -> float:
    """T(k) = 0 for k = 0, else ``min(1, 0.4 + 0.05 * (k - 1))``; k counts transition categories."""
    return min(1.0, TRANSITION_BASE + TRANSITION_STEP * (k - 1)) if k > 0 else 0.0


def jaccard_score(jaccard: float, cap: float) -> float:
    """J = ``min(jaccard, cap) / cap``: linear in the overlap up to ``cap``, then 1."""
    return min(jaccard, cap) / cap


def _scaled(band: Band, x: float, maximum: float) -> float | None:
    score = band.score(x)
    return None if score is None else maximum * score


def _within_token_bounds(spec: WritingRewardSpec, text: str) -> bool:
    low, high = spec.token_bounds
    return low <= token_count(text) <= high


def _gate_scores(spec: WritingRewardSpec, c1: str, c2: str) -> Iterator[tuple[str, float | None]]:
    # A generator, so that nothing after a failed level is computed.
    in_bounds = _within_token_bounds(spec, c1) and _within_token_bounds(spec, c2)
    yield "length", LENGTH_REWARD if in_bounds else None
    yield "ratio", _scaled(spec.ratio_band, char_length_ratio(c1, c2), RATIO_REWARD)
    yield (
        "unique_words",
        _scaled(spec.unique_words_band, unique_word_ratio(c1, c2), UNIQUE_WORDS_REWARD),
    )


def writing_reward(spec: WritingRewardSpec, c1: str, c2: str) -> RewardResult:
    """The gated writing reward of the module docstring, with the task's parameters ``spec``."""
    parts: dict[str, float] = {}
    for name, score in _gate_scores(spec, c1, c2):
        if score is None:
            parts[name] = 0.0
            return RewardResult(total=sum(parts.values()), parts=parts)
        parts[name] = score
    categories = transition_categories(c2)
    if spec.transitions_over_both:
        categories |= transition_categories(c1)
    parts["transitions"] = TRANSITION_WEIGHT * transition_score(len(categories))
    parts["jaccard"] = JACCARD_WEIGHT * jaccard_score(content_jaccard(c1, c2), spec.jaccard_cap)
    return RewardResult(total=sum(parts.values()), parts=parts)


def individual_writing_reward(spec: WritingRewardSpec, seat: int, completion: str) -> RewardResult:
    """Agent ``seat``'s (0 or 1) own reward for ``completion`` alone (module docstring): length gate,
    distinct-word share, and its own transitions where the task's joint reward counts them."""
    if seat not in (0, 1):
        raise ValueError(f"seat must be 0 or 1 (a writing task has two agents), got {seat!r}")
    if not _within_token_bounds(spec, completion):
        return RewardResult(total=0.0, parts={"length": 0.0})
    parts = {"length": LENGTH_REWARD, "unique_words": UNIQUE_WORDS_REWARD * distinct_word_share(completion)}
    if seat == 1 or spec.transitions_over_both:
        parts["transitions"] = TRANSITION_WEIGHT * transition_score(len(transition_categories(completion)))
    return RewardResult(total=sum(parts.values()), parts=parts)


def writing_feedback(spec: WritingRewardSpec, c1: str, c2: str, names: tuple[str, str]) -> tuple[str, str]:
    """What each agent is told after a turn of a writing task (its next observation, in a multi-turn episode): the
    reward's first level the pair fails, said in numbers and for what this agent's part can do about it, or what
    is left to gain at level 4; ``names`` are the two parts' names ("one-sentence summary", "detailed summary").

    Each line reads the reward's own quantities (word counts, length and distinct-word ratios, transition
    categories, shared content words), so a team that follows it raises its reward; nothing tells it the reward's
    formula beyond what a reviewer would say.
    """
    low, high = spec.token_bounds
    counts = (token_count(c1), token_count(c2))
    lengths = [f"Your {names[seat]} has {n} words; it needs {low} to {high}." if not low <= n <= high else
               f"Your {names[seat]}'s length ({n} words) is fine; the {names[1 - seat]} is not." for seat, n in
               enumerate(counts)]
    if not all(low <= n <= high for n in counts):
        return lengths[0], lengths[1]
    rho, band = char_length_ratio(c1, c2), spec.ratio_band
    if not band.full_low <= rho <= band.full_high:
        wanted = f"it should be {band.full_low:g} to {band.full_high:g} times as long"
        said = f"The {names[1]} is {rho:.1f} times as long as the {names[0]}; {wanted}."
        if rho < band.full_low:
            return f"{said} Make yours shorter.", f"{said} Write more."
        return f"{said} Write a little more.", f"{said} Make yours shorter."
    u, band = unique_word_ratio(c1, c2), spec.unique_words_band
    if not band.full_low <= u <= band.full_high:
        said = (f"The {names[1]} uses {u:.1f} times as many different words as the {names[0]}; it should use "
                f"{band.full_low:g} to {band.full_high:g} times as many" if math.isfinite(band.full_high) else
                f"The {names[1]} uses {u:.1f} times as many different words as the {names[0]}; it should use at "
                f"least {band.full_low:g} times as many")
        return (f"{said}. Use fewer, plainer words." if u < band.full_low else f"{said}. Use more varied words.",
                f"{said}. Use more varied words." if u < band.full_low else f"{said}. Repeat key terms more.")
    hints: tuple[list[str], list[str]] = ([], [])
    categories = transition_categories(c2) | (transition_categories(c1) if spec.transitions_over_both else frozenset())
    if transition_score(len(categories)) < 1.0:
        for seat in (0, 1) if spec.transitions_over_both else (1,):  # where level 4 looks for transitions
            hints[seat].append(f"link ideas with more kinds of transition words such as first, because, however, "
                               f"for example, as a result, finally ({len(categories)} kinds so far)")
    if jaccard_score(content_jaccard(c1, c2), spec.jaccard_cap) < 1.0:
        for seat in (0, 1):
            hints[seat].append("use more of the same key words as your teammate's part")
    if not hints[0] and not hints[1]:
        return ("Both parts meet every criterion; keep them as they are.",) * 2
    return tuple(f"The lengths and wording fit. To improve, {' and '.join(mine)}." if mine else
                 "Your part fits; keep it as it is." for mine in hints)  # type: ignore[return-value]


def tldr_reward(summary: str, detailed: str) -> RewardResult:
    """TLDR joint reward (max 3.0) of the concise ``summary`` (c1) and the ``detailed`` one (c2).

    L1 +0.5 if both have 8..256 whitespace tokens (inclusive), else stop.
    L2 with ``rho = len(c2) / len(c1)``: 1.0 on [1.6, 3.2]; ``(rho - 1.1) / 0.5`` on [1.1, 1.6);
    ``1 - (rho - 3.2) / 1.8`` on (3.2, 5.0]; otherwise stop.
    L3 with ``u = |U(c2)| / |U(c1)|``: 0.5 for u >= 2; ``0.5 * (u - 1.3) / 0.7`` on [1.3, 2);
    otherwise stop.
    L4 ``0.4 * T + 0.6 * J``: T from the number of transition categories found in c2,
    ``J = min(jaccard, 0.03) / 0.03``.
    """
    return writing_reward(TLDR_SPEC, summary, detailed)


def arxiv_reward(background: str, methods: str) -> RewardResult:
    """arXiv expansion joint reward (max 3.0) of ``background`` (c1) and ``methods`` (c2).

    L1 +0.5 if both have 128..256 whitespace tokens (inclusive), else stop.
    L2 with ``rho = len(c2) / len(c1)``: 1.0 on [1.3, 1.6]; ``(rho - 0.8) / 0.5`` on [0.8, 1.3);
    ``1 - (rho - 1.6) / 0.4`` on (1.6, 2.0]; otherwise stop.
    L3 with ``u = |U(c2)| / |U(c1)|``: 0.5 on [0.7, 1.3]; ``0.5 * (u - 0.5) / 0.2`` on [0.5, 0.7);
    ``0.5 * (1 - (u - 1.3) / 0.4)`` on (1.3, 1.7]; otherwise stop.
    L4 ``0.4 * T + 0.6 * J``: T from the transition categories found in c1 or c2,
    ``J = min(jaccard, 0.23) / 0.23``.
    """
    return writing_reward(ARXIV_SPEC, background, methods)


def tldr_individual_rewards(summary: str, detailed: str) -> list[RewardResult]:
    """Each TLDR agent's own reward (max 1.0 for the summary, 1.4 for the detailed one): length gate
    8..256 tokens, distinct-word share, and for the detailed summary its transition categories."""
    return [individual_writing_reward(TLDR_SPEC, seat, text) for seat, text in enumerate((summary, detailed))]


def arxiv_individual_rewards(background: str, methods: str) -> list[RewardResult]:
    """Each arXiv agent's own reward (max 1.4 each): length gate 128..256 tokens, distinct-word share,
    and its own transition categories."""
    return [individual_writing_reward(ARXIV_SPEC, seat, text) for seat, text in enumerate((background, methods))]


#: The writing rewards by task name, each a function of (c1, c2).
WRITING_REWARDS: dict[str, Callable[[str, str], RewardResult]] = {
    "tldr": tldr_reward,
    "arxiv": arxiv_reward,
}

#: Each writing reward's maximum total, by task name.
MAX_REWARD: dict[str, float] = {"tldr": WRITING_MAX_REWARD, "arxiv": WRITING_MAX_REWARD}
