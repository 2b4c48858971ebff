r"""Text features the writing rewards are built from.

Every function here is pure and deterministic and uses the standard library only (no NLTK data to
download). The exact rules:

* **Tokens** (the length gate): ``text.split()``, i.e. maximal runs of non-whitespace characters.
* **Words** (vocabulary features): the text is lower-cased, the typographic apostrophe ``’``
  becomes ``'``, and a word is a maximal run of Unicode letters or digits, optionally joined by
  single internal apostrophes (see :data:`WORD_PATTERN`). So ``"Don't stop-loss 2x!"`` has the
  words ``don't``, ``stop``, ``loss``, ``2x``: hyphens and other punctuation separate words, and
  underscores are not letters.
* **Unique words**, U(text): the set of distinct words, **stopwords included**
  (:func:`unique_words`). This is teamrl's one definition of a text's unique words; every reward and
  report that counts them goes through it: the joint writing rewards' level 3
  (``u = |U(c2)| / |U(c1)|``, :func:`unique_word_ratio`), the content words of the Jaccard term
  (:func:`content_words` = U minus stopwords) and the individual writing rewards' vocabulary part
  (:func:`distinct_word_share`).
* **Content words**: U(text) minus :data:`STOPWORDS`.
* **Transition categories**: the categories of :data:`TRANSITION_CATEGORIES` with at least one
  phrase occurring in the text, case-insensitively, on word boundaries (a letter, digit, underscore
  or hyphen next to the phrase prevents the match, so ``then`` is not found in ``strengthen`` nor
  ``first`` in ``first-class``), with any run of whitespace allowed between a phrase's words.

Where the unique-word definition comes from. The paper (arXiv 2508.04652) scores level 3 of its TLDR
and arXiv rewards by the ratio of the two completions' numbers of unique words. The authors' reward
code (``tldr_combined_reward`` and ``arxiv_combined_reward`` in ``rewards/tldr_rewards.py`` and
``rewards/arxiv_rewards.py`` of github.com/OpenMLRL/LLM_Collab_Writing) counts them as
``len(set(re.findall(r"\b\w+\b", text.lower())))`` through ``count_unique_words(c)``, whose
``exclude_stopwords`` argument defaults to False and is not passed: **stopwords are included**,
although the reward functions' docstrings describe level 3 as a "unique words ratio (excluding
stopwords)". teamrl follows what the code computes: stopwords count in level 3. The authors' Jaccard
term drops stopwords, and so does teamrl's. Where teamrl deliberately differs from that code:

* contractions stay one word (``don't``; ``\b\w+\b`` splits it into ``don`` and ``t``, so every
  contraction adds the pseudo-word ``t``, ``s`` or ``ll``), and ``’`` counts as ``'``;
* underscores separate words (``\w`` counts ``_`` as a letter, so ``snake_case`` is one word there);
* the stopword list is :data:`STOPWORDS` (the authors' own list differs, e.g. it holds ``good``,
  ``first`` and ``new`` and no contractions), and a Jaccard of two texts without content words is 0.0
  (1.0 there: an empty pair would earn the full term).
"""

from __future__ import annotations

import re

#: A word: letters/digits (``[^\W_]``); internal apostrophes are kept so contractions stay one word.
WORD_PATTERN = re.compile(r"[^\W_]+(?:'[^\W_]+)*")

#: Function words removed before the Jaccard overlap, so two texts do not look similar merely
#: because both are English. Lower-case, in the form :func:`words` produces (contractions keep their
#: apostrophe).
STOPWORDS: frozenset[str] = frozenset(
    """
    a about above after again against all am an and any are aren't as at
    be because been before being below between both but by
    can can't cannot could couldn't
    did didn't do does doesn't doing don't down during
    each few for from further
    had hadn't has hasn't have haven't having he he'd he'll he's her here here's hers herself him
    himself his how how's
    i i'd i'll i'm i've if in into is isn't it it's its itself
    just let's me more most mustn't my myself
    no nor not now of off on once only or other ought our ours ourselves out over own
    same shan't she she'd she'll she's should shouldn't so some such
    than that that's the their theirs them themselves then there there's these they they'd they'll
    they're they've this those through to too
    under until up us very
    was wasn't we we'd we'll we're we've were weren't what what's when when's where where's which
    while who who's whom why why's will with won't would wouldn't
    you you'd you'll you're you've your yours yourself yourselves
    """.split()
)

#: Transition words and phrases by rhetorical function. A text's transition score counts how many
#: *categories* it uses, so a phrase belongs to exactly one category and no phrase contains (as a
#: run of whole words) a phrase of another category: one phrase never counts twice. There are 14
#: categories because the writing rewards' transition term reaches its maximum at 13 categories.
#: Very common words with a mostly non-transitional use (``so``, ``as``, ``when``, ``that is``) are
#: left out so that ordinary prose does not collect categories by accident.
# fmt: off
TRANSITION_CATEGORIES: dict[str, tuple[str, ...]] = {
    "addition": (
        "additionally", "also", "besides", "furthermore", "moreover", "in addition", "as well as",
        "what is more", "not only", "along with",
    ),
    "contrast": (
        "however", "but", "yet", "in contrast", "by contrast", "on the other hand", "conversely",
        "on the contrary", "whereas", "instead", "rather than", "alternatively", "unlike",
    ),
    "concession": (
        "although", "though", "even though", "even so", "nevertheless", "nonetheless", "despite",
        "in spite of", "admittedly", "regardless", "notwithstanding", "all the same",
    ),
    "cause_effect": (
        "because", "therefore", "thus", "hence", "consequently", "as a result", "accordingly",
        "due to", "owing to", "thanks to", "for this reason", "thereby", "as a consequence",
        "it follows that",
    ),
    "example": (
        "for example", "for instance", "such as", "e.g.", "to illustrate", "as an illustration",
        "namely", "including", "a case in point",
    ),
    "clarification": (
        "in other words", "that is to say", "i.e.", "to put it simply", "simply put", "to clarify",
        "put differently", "more precisely", "specifically",
    ),
    "emphasis": (
        "indeed", "in fact", "notably", "especially", "particularly", "in particular", "above all",
        "most importantly", "importantly", "certainly", "clearly", "of course", "undoubtedly",
        "significantly",
    ),
    "comparison": (
        "similarly", "likewise", "in the same way", "equally", "just as", "just like",
        "by the same token", "compared to", "compared with", "in comparison", "correspondingly",
    ),
    "sequence": (
        "first", "firstly", "second", "secondly", "third", "thirdly", "next", "then", "after that",
        "lastly", "finally", "to begin with", "subsequently", "following this",
    ),
    "time": (
        "meanwhile", "in the meantime", "previously", "afterwards", "afterward", "later",
        "eventually", "initially", "at the same time", "simultaneously", "recently", "formerly",
        "earlier", "until", "nowadays", "currently",
    ),
    "condition": (
        "if", "unless", "provided that", "as long as", "in case", "otherwise", "in the event that",
        "assuming that", "on condition that",
    ),
    "purpose": (
        "in order to", "so that", "so as to", "with the aim of", "for the purpose of",
        "with this in mind",
    ),
    "generalization": (
        "in general", "generally", "as a rule", "for the most part", "typically", "usually",
        "broadly speaking", "in most cases",
    ),
    "conclusion": (
        "in conclusion", "in summary", "to summarize", "to sum up", "in short", "in brief",
        "overall", "all in all", "ultimately", "on the whole", "in the end", "to conclude",
    ),
}
# fmt: on


def _phrase_regex(phrases: tuple[str, ...]) -> re.Pattern[str]:
    # Longest first so that the alternation never stops at a shorter phrase inside a longer one.
    alternatives = sorted(
        (r"\s+".join(map(re.escape, phrase.split())) for phrase in phrases), key=len, reverse=True
    )
    return re.compile(r"(?<![\w-])(?:" + "|".join(alternatives) + r")(?![\w-])", re.IGNORECASE)


_CATEGORY_PATTERNS: dict[str, re.Pattern[str]] = {
    category: _phrase_regex(phrases) for category, phrases in TRANSITION_CATEGORIES.items()
}


def token_count(text: str) -> int:
    """Number of whitespace-separated tokens: ``len(text.split())``."""
    return len(text.split())


def char_length_ratio(reference: str, text: str) -> float:
    """``len(text) / len(reference)`` in characters of the strings as given (nothing is stripped).

    Returns 0.0 when ``reference`` is empty: a ratio to nothing is undefined, and 0.0 lies outside
    every band the rewards accept.
    """
    return len(text) / len(reference) if reference else 0.0


def words(text: str) -> list[str]:
    """The words of ``text`` in order, lower-cased, as matched by :data:`WORD_PATTERN`."""
    return WORD_PATTERN.findall(text.lower().replace("\u2019", "'"))


def unique_words(text: str) -> frozenset[str]:
    """U(text): the set of distinct :func:`words` of ``text``, stopwords included. The one definition of
    a text's unique words that every reward uses (its source: the module docstring)."""
    return frozenset(words(text))


def distinct_word_share(text: str) -> float:
    """``|U(text)| / (number of words of text)``: the share of a text's words that are distinct, 1.0 when
    no word repeats (a lexical-diversity measure: a text going round in circles scores low).

    Returns 0.0 for a text without words.
    """
    count = len(words(text))
    return len(unique_words(text)) / count if count else 0.0


def unique_word_ratio(reference: str, text: str) -> float:
    """Distinct words of ``text`` over distinct words of ``reference``: ``|U(text)| / |U(ref)|``.

    Counts are of :func:`unique_words` (stopwords included). Returns 0.0 when ``reference`` has no
    words, which lies outside every band the rewards accept.
    """
    reference_count = len(unique_words(reference))
    return len(unique_words(text)) / reference_count if reference_count else 0.0


def content_words(text: str) -> frozenset[str]:
    """:func:`unique_words` of ``text`` minus :data:`STOPWORDS`."""
    return unique_words(text) - STOPWORDS


def content_jaccard(a: str, b: str) -> float:
    """Jaccard similarity of the content words of ``a`` and ``b``: ``|A & B| / |A | B|``.

    Returns 0.0 when neither text has a content word: two texts with nothing to compare share no
    content, and a reward should not be earned by writing only stopwords.
    """
    set_a, set_b = content_words(a), content_words(b)
    union = set_a | set_b
    return len(set_a & set_b) / len(union) if union else 0.0


def transition_categories(text: str) -> frozenset[str]:
    """Names of the :data:`TRANSITION_CATEGORIES` with at least one phrase found in ``text``.

    Matching is case-insensitive, on word boundaries (no letter, digit, underscore or hyphen may
    touch the phrase on either side), with any whitespace allowed between a phrase's words.
    """
    return frozenset(
        category for category, pattern in _CATEGORY_PATTERNS.items() if pattern.search(text)
    )
