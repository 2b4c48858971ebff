"""The gated writing rewards, at every boundary of every level, against hand-computed values.

Inputs are built so that each feature is exactly what a test wants: distinct words ``p0 p1 ...``
(never stopwords, never transition phrases), a token count reached by repeating the first word, and
a character length reached by padding the last word with ``x``.
"""

import pytest

from teamrl.rewards import text
from teamrl.rewards.base import RewardResult
from teamrl.rewards.text import TRANSITION_CATEGORIES, content_jaccard, transition_categories
from teamrl.rewards.writing import (
    ARXIV_SPEC,
    MAX_REWARD,
    WRITING_REWARDS,
    arxiv_individual_rewards,
    arxiv_reward,
    individual_writing_reward,
    tldr_individual_rewards,
    tldr_reward,
    transition_score,
)


def vocab(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def doc(distinct: list[str], tokens: int | None = None, chars: int | None = None) -> str:
    """``distinct`` words, the first repeated up to ``tokens``, the last padded up to ``chars``."""
    body = [distinct[0]] * ((tokens or len(distinct)) - len(distinct)) + distinct
    text = " ".join(body)
    if chars is not None:
        assert chars >= len(text), "not enough room for the words"
        text += "x" * (chars - len(text))
    return text


def phrases(k: int) -> list[str]:
    """The first phrase of each of the first k transition categories."""
    return [category_phrases[0] for category_phrases in list(TRANSITION_CATEGORIES.values())[:k]]


def interleave(words: list[str], inserts: list[str]) -> list[str]:
    # A generated word between two phrases, so that no phrase of another category forms across them.
    out = []
    for i, word in enumerate(words):
        out.append(word)
        if i < len(inserts):
            out.append(inserts[i])
    assert len(inserts) < len(words)
    return out


def approx(value: float):
    return pytest.approx(value, rel=1e-12, abs=1e-12)


# Passing inputs for the levels a test is not about.
TLDR_C1 = doc(vocab("p", 10), chars=500)
TLDR_C2 = doc(vocab("q", 30), chars=1000)  # rho = 2, u = 3
ARXIV_C1 = doc(vocab("p", 150), chars=1000)
ARXIV_C2 = doc(vocab("q", 150), chars=1400)  # rho = 1.4, u = 1


def test_helpers_build_the_intended_features():
    assert (len(TLDR_C1), len(TLDR_C1.split())) == (500, 10)
    assert (len(TLDR_C2), len(TLDR_C2.split())) == (1000, 30)
    text = doc(vocab("q", 3), tokens=8, chars=40)
    assert text.split()[:6] == ["q0"] * 6 and len(text) == 40 and len(set(text.split())) == 3


# ------------------------------------------------------------------------------------------ L1


@pytest.mark.parametrize(
    "tokens, passes", [(7, False), (8, True), (9, True), (255, True), (256, True), (257, False)]
)
def test_tldr_length_gate_on_each_completion(tokens, passes):
    probe = doc(vocab("r", 5), tokens=tokens)
    for c1, c2 in ((probe, TLDR_C2), (TLDR_C1, probe)):
        result = tldr_reward(c1, c2)
        if passes:
            assert result.parts["length"] == 0.5 and "ratio" in result.parts
        else:
            assert result == RewardResult(0.0, {"length": 0.0})


@pytest.mark.parametrize(
    "tokens, passes",
    [(127, False), (128, True), (129, True), (255, True), (256, True), (257, False)],
)
def test_arxiv_length_gate_on_each_completion(tokens, passes):
    probe = doc(vocab("r", 5), tokens=tokens)
    for c1, c2 in ((probe, ARXIV_C2), (ARXIV_C1, probe)):
        result = arxiv_reward(c1, c2)
        if passes:
            assert result.parts["length"] == 0.5 and "ratio" in result.parts
        else:
            assert result == RewardResult(0.0, {"length": 0.0})


def test_empty_completion_fails_the_length_gate():
    assert tldr_reward("", TLDR_C2) == RewardResult(0.0, {"length": 0.0})
    assert arxiv_reward(ARXIV_C1, "") == RewardResult(0.0, {"length": 0.0})


# ------------------------------------------------------------------------------------------ L2
# c1 has 1000 characters, so rho = len(c2) / 1000.

TLDR_RATIO_CASES = [
    (1099, None),  # just below 1.1: stop
    (1100, 0.0),  # on 1.1: scores 0 but passes
    (1101, 0.001 / 0.5),
    (1350, 0.5),
    (1599, 0.499 / 0.5),
    (1600, 1.0),
    (2400, 1.0),
    (3200, 1.0),
    (3201, 1 - 0.001 / 1.8),
    (4100, 0.5),
    (4999, 1 - 1.799 / 1.8),
    (5000, 0.0),  # on 5.0: scores 0 but passes
    (5001, None),  # just above 5.0: stop
]


@pytest.mark.parametrize("chars, expected", TLDR_RATIO_CASES)
def test_tldr_ratio_level(chars, expected):
    c1 = doc(vocab("p", 10), chars=1000)
    c2 = doc(vocab("q", 30), chars=chars)
    result = tldr_reward(c1, c2)
    if expected is None:
        assert result == RewardResult(0.5, {"length": 0.5, "ratio": 0.0})
    else:
        assert result.parts["ratio"] == approx(expected)
        assert "unique_words" in result.parts


ARXIV_RATIO_CASES = [
    (799, None),
    (800, 0.0),
    (801, 0.001 / 0.5),
    (1050, 0.5),
    (1299, 0.499 / 0.5),
    (1300, 1.0),
    (1450, 1.0),
    (1600, 1.0),
    (1601, 1 - 0.001 / 0.4),
    (1800, 0.5),
    (1999, 1 - 0.399 / 0.4),
    (2000, 0.0),
    (2001, None),
]


@pytest.mark.parametrize("chars, expected", ARXIV_RATIO_CASES)
def test_arxiv_ratio_level(chars, expected):
    c1 = doc(vocab("p", 150), chars=1000)
    c2 = doc(vocab("q", 150), chars=chars)
    result = arxiv_reward(c1, c2)
    if expected is None:
        assert result == RewardResult(0.5, {"length": 0.5, "ratio": 0.0})
    else:
        assert result.parts["ratio"] == approx(expected)
        assert "unique_words" in result.parts


# ------------------------------------------------------------------------------------------ L3
# TLDR: c1 has 10 distinct words, so u = distinct words of c2 / 10.

TLDR_UNIQUE_CASES = [
    (12, None),  # 1.2: stop
    (13, 0.0),  # on 1.3: scores 0 but passes
    (14, 0.5 * 0.1 / 0.7),
    (19, 0.5 * 0.6 / 0.7),
    (20, 0.5),  # on 2.0
    (21, 0.5),
    (60, 0.5),  # no upper limit
]


@pytest.mark.parametrize("distinct, expected", TLDR_UNIQUE_CASES)
def test_tldr_unique_words_level(distinct, expected):
    c1 = doc(vocab("p", 10), chars=500)
    c2 = doc(vocab("q", distinct), tokens=60, chars=1000)
    result = tldr_reward(c1, c2)
    if expected is None:
        assert result == RewardResult(1.5, {"length": 0.5, "ratio": 1.0, "unique_words": 0.0})
    else:
        assert result.parts["unique_words"] == approx(expected)
        assert {"transitions", "jaccard"} <= result.parts.keys()


# arXiv: c1 has 150 distinct words, so u = distinct words of c2 / 150.

ARXIV_UNIQUE_CASES = [
    (74, None),  # 0.4933: stop
    (75, 0.0),  # on 0.5: scores 0 but passes
    (76, 0.5 * (76 / 150 - 0.5) / 0.2),
    (90, 0.25),  # 0.6
    (104, 0.5 * (104 / 150 - 0.5) / 0.2),
    (105, 0.5),  # on 0.7
    (150, 0.5),
    (195, 0.5),  # on 1.3
    (196, 0.5 * (1 - (196 / 150 - 1.3) / 0.4)),
    (225, 0.25),  # 1.5
    (254, 0.5 * (1 - (254 / 150 - 1.3) / 0.4)),
    (255, 0.0),  # on 1.7: scores 0 but passes
    (256, None),  # 1.7067: stop
]


@pytest.mark.parametrize("distinct, expected", ARXIV_UNIQUE_CASES)
def test_arxiv_unique_words_level(distinct, expected):
    c1 = doc(vocab("p", 150), chars=1000)
    c2 = doc(vocab("q", distinct), tokens=max(distinct, 128), chars=1400)
    result = arxiv_reward(c1, c2)
    if expected is None:
        assert result == RewardResult(1.5, {"length": 0.5, "ratio": 1.0, "unique_words": 0.0})
    else:
        assert result.parts["unique_words"] == approx(expected)
        assert {"transitions", "jaccard"} <= result.parts.keys()


def test_unique_words_level_stops_when_c1_has_no_words():
    c1 = " ".join(["--"] * 10)  # 10 tokens, 29 characters, no word
    c2 = doc(vocab("q", 20), chars=80)  # rho = 80 / 29
    expected = RewardResult(1.5, {"length": 0.5, "ratio": 1.0, "unique_words": 0.0})
    assert tldr_reward(c1, c2) == expected


# ------------------------------------------------------------------------------------------ L4: T


# T(k) by hand: 0 without a category, 0.4 + 0.05 * (k - 1) capped at 1 (reached at k = 13).
T_CASES = [(0, 0.0), (1, 0.4), (2, 0.45), (5, 0.6), (12, 0.95), (13, 1.0), (14, 1.0)]


@pytest.mark.parametrize("k, t", T_CASES)
def test_transition_score(k, t):
    assert transition_score(k) == approx(t)


@pytest.mark.parametrize("k, t", T_CASES)
def test_tldr_transitions_counted_in_c2(k, t):
    c2 = doc(interleave(vocab("q", 40), phrases(k)), chars=1000)
    assert len(transition_categories(c2)) == k
    result = tldr_reward(TLDR_C1, c2)
    assert result.parts["transitions"] == approx(0.4 * t)
    assert result.parts["jaccard"] == 0.0  # no shared content word
    assert result.total == approx(2.0 + 0.4 * t)


def test_tldr_ignores_transitions_in_c1():
    c1 = doc(interleave(vocab("p", 8), phrases(3)), chars=500)
    result = tldr_reward(c1, TLDR_C2)
    assert result.parts["transitions"] == 0.0


@pytest.mark.parametrize(
    "k1, k2, t", [(0, 0, 0.0), (3, 0, 0.5), (0, 3, 0.5), (3, 3, 0.5), (13, 0, 1.0)]
)
def test_arxiv_transitions_counted_over_both_completions(k1, k2, t):
    # Both completions use the first categories, so together they use max(k1, k2) categories.
    c1 = doc(interleave(vocab("p", 150), phrases(k1)), chars=1000)
    c2 = doc(interleave(vocab("q", 150), phrases(k2)), chars=1400)
    result = arxiv_reward(c1, c2)
    assert result.parts["unique_words"] == 0.5
    assert result.parts["transitions"] == approx(0.4 * t)


def test_arxiv_counts_distinct_categories_across_completions():
    all_phrases = phrases(4)
    c1 = doc(interleave(vocab("p", 150), all_phrases[:2]), chars=1000)
    c2 = doc(interleave(vocab("q", 150), all_phrases[2:]), chars=1400)
    assert arxiv_reward(c1, c2).parts["transitions"] == approx(0.4 * 0.55)


# ------------------------------------------------------------------------------------------ L4: J


def shared_texts(shared: int, own1: int, own2: int, tokens: int, chars1: int, chars2: int):
    """c1 and c2 sharing ``shared`` content words, with ``own1``/``own2`` words of their own."""
    common = vocab("s", shared)
    c1 = doc(common + vocab("p", own1), tokens=tokens, chars=chars1)
    c2 = doc(common + vocab("q", own2), tokens=tokens, chars=chars2)
    return c1, c2


# TLDR: a union of 100 content words; c1 has 20 + shared, c2 80 (u >= 3.2).
@pytest.mark.parametrize(
    "shared, raw, j", [(0, 0.0, 0.0), (2, 0.02, 0.02 / 0.03), (3, 0.03, 1.0), (5, 0.05, 1.0)]
)
def test_tldr_jaccard_capped_at_0_03(shared, raw, j):
    c1, c2 = shared_texts(shared, 20, 80 - shared, tokens=80, chars1=500, chars2=1000)
    assert content_jaccard(c1, c2) == raw
    result = tldr_reward(c1, c2)
    assert result.parts["transitions"] == 0.0
    assert result.parts["jaccard"] == approx(0.6 * j)


# arXiv: a union of 200 content words; c1 and c2 have 100 + shared / 2 each (u = 1).
@pytest.mark.parametrize(
    "shared, raw, j", [(0, 0.0, 0.0), (40, 0.2, 0.2 / 0.23), (46, 0.23, 1.0), (60, 0.3, 1.0)]
)
def test_arxiv_jaccard_capped_at_0_23(shared, raw, j):
    own = 100 - shared // 2
    c1, c2 = shared_texts(shared, own, own, tokens=160, chars1=1000, chars2=1400)
    assert content_jaccard(c1, c2) == raw
    result = arxiv_reward(c1, c2)
    assert result.parts["unique_words"] == 0.5
    assert result.parts["jaccard"] == approx(0.6 * j)


# ------------------------------------------------------------------------------------------ totals


def test_tldr_reaches_its_maximum():
    common = vocab("s", 5)
    c1 = doc(common + vocab("p", 15), chars=500)
    c2 = doc(interleave(common + vocab("q", 60), phrases(13)), chars=1000)
    assert tldr_reward(c1, c2) == RewardResult(
        3.0, {"length": 0.5, "ratio": 1.0, "unique_words": 0.5, "transitions": 0.4, "jaccard": 0.6}
    )


def test_arxiv_reaches_its_maximum():
    common = vocab("s", 80)
    c1 = doc(interleave(common + vocab("p", 80), phrases(7)), chars=1000)
    c2 = doc(interleave(common + vocab("q", 80), phrases(14)[7:]), chars=1400)
    result = arxiv_reward(c1, c2)
    assert result.total == 3.0 == MAX_REWARD["arxiv"]
    assert result.parts["transitions"] == 0.4


def test_total_is_sum_of_parts_on_a_mid_range_example():
    c1 = doc(vocab("p", 10), chars=1000)
    c2 = doc(interleave(vocab("q", 14), phrases(2)), chars=1350)  # rho 1.35, u 1.6, k 2, J 0
    result = tldr_reward(c1, c2)
    expected = {
        "length": 0.5,
        "ratio": 0.5,
        "unique_words": 0.5 * 0.3 / 0.7,
        "transitions": 0.4 * 0.45,
        "jaccard": 0.0,
    }
    assert result.parts.keys() == expected.keys()
    for name, value in expected.items():
        assert result.parts[name] == approx(value)
    assert result.total == approx(sum(expected.values()))


def test_registry_and_maxima():
    assert WRITING_REWARDS == {"tldr": tldr_reward, "arxiv": arxiv_reward}
    assert MAX_REWARD == {"tldr": 3.0, "arxiv": 3.0}


# --------------------------------------------------------------------------------------------------
# Individual rewards (the independent-learner baseline): each agent's completion alone

#: 13 transition categories in 13 distinct single words (no purpose phrase: those all have two words).
THIRTEEN_CATEGORIES = ("additionally however although because namely specifically indeed similarly first "
                       "meanwhile unless generally overall")


def test_thirteen_categories_in_distinct_words():
    assert len(transition_categories(THIRTEEN_CATEGORIES)) == 13
    assert len(text.words(THIRTEEN_CATEGORIES)) == len(text.unique_words(THIRTEEN_CATEGORIES)) == 13


def test_tldr_individual_rewards_hand_computed():
    # 8 tokens = 8 words, 5 distinct {however, p0, p1, p2, p3}: share 5/8; one category (contrast): T = 0.4
    repetitive = "however p0 p1 p2 p0 p1 p2 p3"
    summary, detailed = tldr_individual_rewards(repetitive, repetitive)
    # the summary's transitions do not count (the joint reward searches the detailed summary only)
    assert summary == RewardResult(0.5 + 0.5 * 5 / 8, {"length": 0.5, "unique_words": 0.5 * 5 / 8})
    assert detailed.parts == approx({"length": 0.5, "unique_words": 0.3125, "transitions": 0.4 * 0.4})
    assert detailed.total == approx(0.5 + 0.3125 + 0.16)


def test_individual_writing_rewards_maxima():
    summary, detailed = tldr_individual_rewards(THIRTEEN_CATEGORIES, THIRTEEN_CATEGORIES)
    assert summary.total == approx(1.0) and detailed.total == approx(1.4)
    long = THIRTEEN_CATEGORIES + " " + " ".join(vocab("p", 115))  # 128 tokens, all distinct
    assert [r.total for r in arxiv_individual_rewards(long, long)] == approx([1.4, 1.4])  # both agents' transitions


@pytest.mark.parametrize("tokens", [7, 257])
def test_individual_length_gate_stops_scoring(tokens):
    completion = doc(vocab("p", 7), tokens=tokens)
    assert tldr_individual_rewards(completion, completion) == [RewardResult(0.0, {"length": 0.0})] * 2


def test_arxiv_individual_rewards_hand_computed_at_the_token_bounds():
    # 128 tokens: 64 distinct words each said twice -> share 0.5; "however" is one of them (T = 0.4)
    words = ["however", *vocab("p", 63)]
    completion = " ".join(words + words)
    expected = RewardResult(0.5 + 0.25 + 0.16, {"length": 0.5, "unique_words": 0.25, "transitions": 0.4 * 0.4})
    background, methods = arxiv_individual_rewards(completion, completion)
    for result in (background, methods):
        assert result.parts == approx(expected.parts) and result.total == approx(expected.total)
    assert arxiv_individual_rewards(" ".join(words), completion)[0] == RewardResult(0.0, {"length": 0.0})  # 64


def test_an_agents_individual_reward_ignores_its_partner():
    own = doc(vocab("p", 9), tokens=12)
    for partner in ("", THIRTEEN_CATEGORIES, doc(vocab("q", 40))):
        assert tldr_individual_rewards(own, partner)[0] == tldr_individual_rewards(own, "x")[0]
        assert tldr_individual_rewards(partner, own)[1] == tldr_individual_rewards("x", own)[1]


def test_individual_writing_reward_rejects_a_third_seat():
    with pytest.raises(ValueError, match="seat must be 0 or 1"):
        individual_writing_reward(ARXIV_SPEC, 2, THIRTEEN_CATEGORIES)


# --------------------------------------------------------------------------------------------------
# One definition of a text's unique words, used by every reward


def test_every_reward_counts_unique_words_through_text_unique_words(monkeypatch):
    summary = " ".join(vocab("p", 10))   # 10 distinct words, 29 characters
    detailed = " ".join(vocab("q", 15))  # 15 distinct words, 49 characters: rho = 49 / 29 = 1.69
    # Real definition: u = 15 / 10 = 1.5 -> 0.5 * (1.5 - 1.3) / 0.7 ; no shared content word -> Jaccard 0
    real = tldr_reward(summary, detailed)
    assert real.parts["unique_words"] == approx(0.5 * 0.2 / 0.7) and real.parts["jaccard"] == 0.0
    assert tldr_individual_rewards(summary, detailed)[1].parts["unique_words"] == approx(0.5)

    # Every text gains the same extra "unique word": each consumer must change accordingly.
    real_unique_words = text.unique_words
    monkeypatch.setattr(text, "unique_words", lambda t: real_unique_words(t) | {"zzmarker"})
    patched = tldr_reward(summary, detailed)
    assert patched.parts["unique_words"] == approx(0.5 * (16 / 11 - 1.3) / 0.7)  # level 3: u = 16 / 11
    # Jaccard's content words come from it too: 1 shared of 26 = 0.038 >= cap 0.03 -> J = 1
    assert patched.parts["jaccard"] == approx(0.6)
    assert content_jaccard(summary, detailed) == approx(1 / 26)
    summary_own, detailed_own = tldr_individual_rewards(summary, detailed)
    assert summary_own.parts["unique_words"] == approx(0.5 * 11 / 10)
    assert detailed_own.parts["unique_words"] == approx(0.5 * 16 / 15)
