"""The paper's two writing tasks: TLDR two-level summaries (``"tldr"``) and arXiv abstract expansion (``"arxiv"``).

Both are single-turn, two-agent tasks. Each agent sees the same text with its own instructions and
writes its part without seeing its partner's; one joint reward
(:func:`~teamrl.rewards.writing.tldr_reward` or :func:`~teamrl.rewards.writing.arxiv_reward`, max 3.0)
scores the pair, with the reward's levels as the result's ``parts``. For the independent-learner
baseline each agent also has its own reward of its completion alone
(:func:`~teamrl.rewards.writing.individual_writing_reward`).

Data sources (the ``source`` argument), all read through :mod:`teamrl.data`:

* ``"aclsum"`` (default, offline): the ACL papers of the ``aclsum`` package; the abstract is the text,
  and for arXiv the paper's introduction is kept as the item's ``reference``. Splits: train (100) and,
  held out, validation (50).
* ``"hub"``: the paper's dataset on the Hugging Face hub (needs ``datasets`` and a network):
  ``trl-lib/tldr`` (field ``prompt``; the human TL;DR ``completion`` is the reference; eval on ``test``)
  or ``OpenMLRL/arXiv_abstract`` (field ``abstract_text``, id ``article_id``; eval on ``val``).
* anything else: a local file (``.jsonl``, ``.json``, ``.csv``, ``.parquet``) or another hub dataset
  id, with the text in ``text_field`` (default ``"text"``). A file without splits is split
  deterministically (``eval_size``, ``seed``); a path containing ``{split}`` names one file a split.

The single-agent baseline (``teamrl eval``) asks one model for both parts as two paragraphs; the
first paragraph is scored as agent 0's completion and the rest as agent 1's.

Items are dicts with ``id``, ``text`` (what the agents read, cut to ``max_text_chars``) and, where the
source has one, ``reference``. The eval items never overlap the training items: an eval item whose id
or text is also a training item's is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from teamrl import data
from teamrl.envs.base import Environment, Item, Step, register_env, sparse_too_short
from teamrl.rewards.base import RewardResult
from teamrl.rewards.text import TRANSITION_CATEGORIES
from teamrl.rewards.writing import (
    ARXIV_SPEC,
    TLDR_SPEC,
    WRITING_MAX_REWARD,
    WritingRewardSpec,
    arxiv_individual_rewards,
    arxiv_reward,
    tldr_individual_rewards,
    tldr_reward,
    writing_feedback,
)

#: Marks where :func:`truncate` cut a text.
ELLIPSIS = " ..."
#: The answer that, with ``keep``, holds an agent's previous text (case, spaces and end punctuation ignored).
KEEP = "KEEP"
#: A blank line: what separates the single-agent baseline's paragraphs.
_BLANK_LINE = re.compile(r"\n\s*\n")
#: The "Paragraph 1:" label the single-agent prompt uses, when a model echoes it.
_PARAGRAPH_LABEL = re.compile(r"^paragraph\s*\d+\s*[:.]\s*", re.IGNORECASE)


@dataclass(frozen=True)
class SourceLayout:
    """Where a source keeps what a writing task needs.

    ``text_field``: the text both agents read. ``id_field``: a unique id per record (None: ids are
    made from the split and the record's position). ``reference_field``: a human-written target kept
    in the item as ``reference`` (None: no reference). ``eval_split``: the held-out split's name.
    """

    text_field: str
    id_field: str | None = None
    reference_field: str | None = None
    eval_split: str = "validation"


def truncate(text: str, max_chars: int | None) -> str:
    """``text`` stripped, and cut to at most ``max_chars`` characters if longer.

    A cut text ends at the last whitespace inside the limit (a word is never split unless it is the
    only one) and is marked with :data:`ELLIPSIS`, which counts towards ``max_chars``.
    ``max_chars`` must exceed ``len(ELLIPSIS)``; None keeps the whole text.
    """
    text = text.strip()
    if max_chars is None or len(text) <= max_chars:
        return text
    head = text[: max_chars - len(ELLIPSIS)]
    if not head[-1].isspace() and not text[len(head)].isspace():
        # the cut falls inside a word: drop its first part, unless it is the only word
        words = head.rsplit(None, 1)
        head = words[0] if len(words) == 2 else head
    return head.rstrip() + ELLIPSIS


class WritingEnv(Environment):
    """A two-agent writing task over a text, of one turn or several; subclasses fix the task (prompts, reward,
    data).

    With ``turns`` > 1 each agent, after a turn, sees its own answer, its teammate's and feedback on them
    (:func:`~teamrl.rewards.writing.writing_feedback`: the reward's first failed level, in numbers, or what is left
    to gain) and revises its part. Every turn's joint reward scores the texts the team holds after it (a state
    reward: an episode's return is the sum over its turns, so a team that gets good early and keeps it earns
    most); with ``sparse`` only the last turn is scored. With ``keep`` a revising agent may answer :data:`KEEP`
    to hold its text as it is, so keeping a good part costs one word instead of retyping it at temperature 1.

    Args:
        source: ``"aclsum"``, ``"hub"``, a local file path or a hub dataset id (see the module docstring).
        text_field: field holding the text; default: the source's (``"text"`` for files and other ids).
        id_field: field holding a unique id; default: the source's, or ``"id"`` when a file's records
            all have one; otherwise an item's id is its position in the source, ``"<split>-<position>"``
            for a source with splits.
        reference_field: field kept as the item's ``reference``; default: the source's (none for files).
        train_split: the source's training split (ignored for a file without splits).
        eval_split: the source's held-out split; default: the source's (``"validation"`` for files with
            ``{split}`` and for other hub ids).
        num_train: at most this many training items, the first ones of the split (None: all).
        num_eval: at most this many eval items (None: all).
        eval_size: for a source without splits, how many records are held out for eval: a count
            (int >= 1) or a fraction (float in (0, 1)).
        seed: seed of that hold-out split.
        max_text_chars: cut each text to at most this many characters (None: keep whole texts).
        turns: the episode's most turns (``algorithm.num_turns`` may play fewer, unless ``sparse``).
        sparse: score only the last of ``turns`` turns (earlier turns earn 0), for the credit-assignment study of
            docs/reports; the shaped default scores every turn.
        keep: from the second turn on, an agent that answers :data:`KEEP` holds its previous text (the prompt
            says so); the reward and the teammate then read that text. Without it every revision is a fresh
            text, and a part that met every criterion is lost to a worse rewrite as often as not.
        feedback: False leaves the feedback out of a later turn's observation (the two answers stay), to
            measure what the feedback itself is worth to a team: evaluate it both ways, same items and seed.

    Attributes ``source`` (the resolved source: ``"hub"`` becomes the hub dataset id) and ``layout``
    (the fields and eval split in use) record what was loaded.
    """

    num_agents = 2
    max_turns = 1  # a task built with env.kwargs.turns plays that many
    max_reward = WRITING_MAX_REWARD
    #: The task's reward, a function of (agent 0's completion, agent 1's completion).
    reward: Callable[[str, str], RewardResult]
    #: Each agent's own reward (the independent-learner baseline), agent i's a function of its completion alone.
    agent_rewards: Callable[[str, str], list[RewardResult]]
    #: Hub dataset used by ``source="hub"`` and where it keeps the task's fields.
    hub_dataset: str
    hub_layout: SourceLayout
    #: Where aclsum keeps the task's fields.
    aclsum_layout: SourceLayout
    #: How the observation introduces the text ("Text", "Abstract").
    text_label: str
    #: Each agent's instruction, placed after the text in its observation (closest to where it writes).
    instructions: tuple[str, str]
    #: The reward's parameters, which the between-turn feedback reads.
    spec: WritingRewardSpec

    def __init__(
        self,
        source: str = data.ACLSUM,
        *,
        text_field: str | None = None,
        id_field: str | None = None,
        reference_field: str | None = None,
        train_split: str = "train",
        eval_split: str | None = None,
        num_train: int | None = 1000,
        num_eval: int | None = 1000,
        eval_size: int | float = 0.2,
        seed: int = 0,
        max_text_chars: int | None = None,
        turns: int = 1,
        sparse: bool = False,
        keep: bool = False,
        feedback: bool = True,
    ):
        _check_limit("turns", turns)
        if sparse and turns < 2:
            raise ValueError("env.kwargs.sparse: a sparse reward pays the last of several turns; set env.kwargs.turns "
                             "to 2 or more, or leave sparse out")
        if keep and turns < 2:
            raise ValueError("env.kwargs.keep: KEEP holds a text from an earlier turn; set env.kwargs.turns to 2 or "
                             "more, or leave keep out")
        self.max_turns, self.sparse, self.keep, self.feedback = turns, sparse, keep, feedback
        _check_limit("num_train", num_train)
        _check_limit("num_eval", num_eval)
        _check_limit("max_text_chars", max_text_chars, minimum=len(ELLIPSIS) + 1)
        if isinstance(eval_size, bool) or not (
            (isinstance(eval_size, int) and eval_size >= 1) or (isinstance(eval_size, float) and 0 < eval_size < 1)
        ):
            raise ValueError(f"env.kwargs.eval_size: must be an int >= 1 or a float in (0, 1) (got {eval_size!r})")
        self.source = self.hub_dataset if source == "hub" else source
        default = self._default_layout(source)
        self.layout = SourceLayout(
            text_field=text_field or default.text_field,
            id_field=id_field or default.id_field,
            reference_field=reference_field or default.reference_field,
            eval_split=eval_split or default.eval_split,
        )
        self.max_text_chars = max_text_chars
        if data.has_splits(self.source):
            train = self._load(train_split, num_train)
            evaluation = self._load(self.layout.eval_split, num_eval)
        else:
            everything = self._load(None, None)
            try:
                train, evaluation = data.holdout_split(everything, eval_size, seed)
            except data.DataError as err:
                raise data.DataError(f"env.kwargs.eval_size: {self.source}: {err}") from None
            train, evaluation = train[:num_train], evaluation[:num_eval]
        self.splits = {"train": train, "eval": _without_overlap(evaluation, train)}
        if not self.splits["eval"]:
            raise data.DataError(
                f"{self.source}: every eval item repeats a training item (same id or text); "
                "hold out other records (env.kwargs.eval_split, eval_size or seed)"
            )

    def _default_layout(self, source: str) -> SourceLayout:
        if source in ("hub", self.hub_dataset):
            return self.hub_layout
        if source == data.ACLSUM:
            return self.aclsum_layout
        return SourceLayout(text_field="text")

    def _load(self, split: str | None, limit: int | None) -> list[Item]:
        """The items of ``split`` of the source (all of a file without splits when None), first ``limit``."""
        layout = self.layout
        fields = [f for f in (layout.text_field, layout.id_field, layout.reference_field) if f]
        try:
            records = data.load_records(self.source, split, limit=limit, fields=fields)
        except data.MissingFieldError as err:
            setting = {layout.text_field: "text_field", layout.id_field: "id_field"}.get(err.field, "reference_field")
            raise data.DataError(f"{err}; set env.kwargs.{setting} to one of its fields") from None
        id_field = layout.id_field or ("id" if all("id" in r for r in records) else None)
        prefix = f"{split}-" if split is not None else ""
        items = [self._item(record, index, id_field, prefix) for index, record in enumerate(records)]
        _check_unique_ids(items, self.source, split)
        return items

    def _item(self, record: dict, index: int, id_field: str | None, prefix: str) -> Item:
        text = record[self.layout.text_field]
        if not isinstance(text, str) or not text.strip():
            raise data.DataError(
                f"{self.source}: record {index} field {self.layout.text_field!r} is empty or not text "
                f"({str(text)[:40]!r}); set env.kwargs.text_field to the field holding the text"
            )
        item: Item = {
            "id": str(record[id_field]) if id_field else f"{prefix}{index}",
            "text": truncate(text, self.max_text_chars),
        }
        if self.layout.reference_field:
            item["reference"] = record[self.layout.reference_field]
        return item


    def observe(self, item: Item) -> list[str]:
        """Each agent's user message: the text under :attr:`text_label`, then that agent's instruction."""
        return [f"{self.text_label}:\n{item['text']}\n\n{instruction}" for instruction in self.instructions]

    def vocabulary(self) -> list[str]:
        """For the word-level 'tiny' test model: every whitespace token of the roles, of every item's
        observations and of the transition phrases the reward looks for, in first-seen order."""
        observations = (obs for items in self.splits.values() for item in items for obs in self.observe(item))
        phrases = (phrase for group in TRANSITION_CATEGORIES.values() for phrase in group)
        extra = (KEEP,) if self.keep else ()
        return list(dict.fromkeys(token for text in (*self.roles, *observations, *phrases, *extra)
                                  for token in text.split()))

    def single_agent_observation(self, item: Item) -> str:
        """The text, then both agents' instructions as the two paragraphs of one answer."""
        paragraphs = "\n".join(f"Paragraph {seat}: {instruction}"
                               for seat, instruction in enumerate(self.instructions, 1))
        return (f"{self.text_label}:\n{item['text']}\n\n"
                f"Write exactly two paragraphs separated by a blank line, and nothing else.\n{paragraphs}")

    def split_single_agent_output(self, item: Item, completion: str) -> list[str]:
        """The first paragraph is agent 0's part, the rest agent 1's (empty when there is only one: the
        single agent missed the layout it was asked for, and the reward's length level says so)."""
        paragraphs = [_PARAGRAPH_LABEL.sub("", part.strip()) for part in _BLANK_LINE.split(completion.strip())]
        paragraphs = [part for part in paragraphs if part]
        return [paragraphs[0] if paragraphs else "", "\n\n".join(paragraphs[1:])]

    def next_observations(self, item: Item, history: Sequence[Step]) -> list[str]:
        """After a turn, each agent's first observation, then its own answer, its teammate's and the feedback on
        them (:func:`~teamrl.rewards.writing.writing_feedback`), and a request to revise its part (with ``keep``:
        or to answer :data:`KEEP`)."""
        last = self.held_texts(history[-1].actions, history[:-1])
        feedback = ([f"Feedback: {line}\n\n" for line in writing_feedback(self.spec, *last, self.output_names)]
                    if self.feedback else ["", ""])
        keeping = f" If it needs no change, write only {KEEP}." if self.keep else ""
        return [f"{observation}\n\nYour {self.output_names[seat]}:\n{last[seat]}\n\nYour teammate's "
                f"{self.output_names[1 - seat]}:\n{last[1 - seat]}\n\n{feedback[seat]}"
                f"Write your {self.output_names[seat]} again, improved, and nothing else.{keeping}"
                for seat, observation in enumerate(self.observe(item))]

    def held_texts(self, actions: Sequence[str], history: Sequence[Step] = ()) -> tuple[str, str]:
        """The two texts the team holds after a turn that answered ``actions``: each answer, or with ``keep``,
        where an agent answered :data:`KEEP` after a first turn, the text it held before."""
        answers = self._pair(actions)
        if not (self.keep and history):
            return answers
        before = self.held_texts(history[-1].actions, history[:-1])
        first, second = (earlier if is_keep(answer) else answer for answer, earlier in zip(answers, before))
        return first, second

    def check_num_turns(self, num_turns: int, field: str = "algorithm.num_turns") -> None:
        super().check_num_turns(num_turns, field)
        if self.sparse and num_turns < self.max_turns:
            raise ValueError(sparse_too_short(field, num_turns, self.max_turns, "turns"))

    def joint_reward(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> RewardResult:
        """The task's reward of (agent 0's completion, agent 1's completion), levels in ``parts``; with
        ``sparse``, 0 (no parts) before the last turn."""
        if self.sparse and len(history) + 1 < self.max_turns:
            return RewardResult(0.0, {})
        return self.reward(*self.held_texts(actions, history))

    def individual_rewards(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> list[float]:
        """Each agent's own reward (:attr:`agent_rewards`): agent i's depends on ``actions[i]`` alone (with
        ``sparse``, 0 before the last turn, as the joint reward)."""
        if self.sparse and len(history) + 1 < self.max_turns:
            return [0.0] * self.num_agents
        return [result.total for result in self.agent_rewards(*self.held_texts(actions, history))]

    def _pair(self, actions: Sequence[str]) -> tuple[str, str]:
        if len(actions) != self.num_agents:
            raise ValueError(f"{type(self).__name__} needs one completion per agent (2), got {len(actions)}")
        return actions[0], actions[1]


def is_keep(answer: str) -> bool:
    """Whether ``answer`` is :data:`KEEP` (any case, with spaces, quotes or end punctuation around it)."""
    return answer.strip().strip("\"'.!").strip().upper() == KEEP


def _check_limit(name: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"env.kwargs.{name}: must be an int >= {minimum} or null for no limit (got {value!r})")


def _check_unique_ids(items: Sequence[Item], source: str, split: str | None) -> None:
    seen: set[str] = set()
    for item in items:
        if item["id"] in seen:
            where = f"{source} {split}" if split else source
            raise data.DataError(
                f"{where}: id {item['id']!r} occurs twice; set env.kwargs.id_field to a field with unique values"
            )
        seen.add(item["id"])


def _without_overlap(evaluation: Sequence[Item], train: Sequence[Item]) -> list[Item]:
    """The eval items whose id and text both differ from every training item's."""
    ids = {item["id"] for item in train}
    texts = {item["text"] for item in train}
    return [item for item in evaluation if item["id"] not in ids and item["text"] not in texts]


@register_env("tldr")
class TldrEnv(WritingEnv):
    """TL;DR two-level summaries: agent 0 writes a one-sentence summary, agent 1 a detailed paragraph.

    Joint reward: :func:`teamrl.rewards.writing.tldr_reward` (max 3.0): both 8..256 tokens, the detailed
    summary 1.6-3.2x longer with about twice the distinct words, transition words, shared content words.
    Keyword arguments: see :class:`WritingEnv`.
    """

    reward = staticmethod(tldr_reward)
    agent_rewards = staticmethod(tldr_individual_rewards)
    spec = TLDR_SPEC
    hub_dataset = "trl-lib/tldr"
    hub_layout = SourceLayout(text_field="prompt", reference_field="completion", eval_split="test")
    aclsum_layout = SourceLayout(text_field="abstract", id_field="id")
    text_label = "Text"
    roles = (
        "You write very short summaries. A teammate writes the detailed summary of the same text, so you "
        "give only the main point: one plain sentence, no lists, no preamble.",
        "You write detailed summaries. A teammate writes the one-sentence summary of the same text, so you "
        "explain the key points, the reasons and the outcome in one paragraph, linking ideas with words such "
        "as first, because, however and finally. No lists, no preamble.",
    )
    output_names = ("one-sentence summary", "detailed summary")
    single_agent_role = (
        "You write summaries at two levels of detail: first the main point in one plain sentence, then a "
        "detailed paragraph that explains the key points, the reasons and the outcome, linking ideas with "
        "words such as first, because, however and finally. No lists, no headings, no preamble."
    )
    instructions = (
        "In one sentence of 15 to 25 words, state the main point of the text above.",
        "Summarize the text above in detail: one paragraph of 3 to 4 sentences, in your own words.",
    )


@register_env("arxiv")
class ArxivEnv(WritingEnv):
    """arXiv expansion: from an abstract, agent 0 writes background & motivation, agent 1 methods & implications.

    Joint reward: :func:`teamrl.rewards.writing.arxiv_reward` (max 3.0): both 128..256 tokens, the second
    part 1.3-1.6x longer with a similar number of distinct words, transitions, shared content words.
    Completions need room: ``max_new_tokens`` of about 350 or more. Keyword arguments: see
    :class:`WritingEnv`.
    """

    reward = staticmethod(arxiv_reward)
    agent_rewards = staticmethod(arxiv_individual_rewards)
    spec = ARXIV_SPEC
    hub_dataset = "OpenMLRL/arXiv_abstract"
    hub_layout = SourceLayout(text_field="abstract_text", id_field="article_id", eval_split="val")
    aclsum_layout = SourceLayout(text_field="abstract", id_field="id", reference_field="introduction")
    text_label = "Abstract"
    roles = (
        "You write the first part of a research paper's introduction: the background and motivation. A "
        "teammate writes the methods and implications, so you do not describe the method or its results. "
        "Write plain paragraphs of prose, no headings, no lists.",
        "You write the second part of a research paper's introduction: the methods and implications. A "
        "teammate writes the background and motivation, so you do not repeat them. Explain what the paper "
        "does, how, what it finds and why it matters. Write plain paragraphs of prose, no headings, no lists.",
    )
    output_names = ("background and motivation", "methods and implications")
    single_agent_role = (
        "You write a research paper's introduction: first the background and motivation, then the methods "
        "and implications (what the paper does, how, what it finds and why it matters). Write plain "
        "paragraphs of prose, no headings, no lists."
    )
    instructions = (
        "Write the background and motivation for this paper's introduction (about 150 words).",
        "Write the methods and implications for this paper's introduction (about 200 words).",
    )
