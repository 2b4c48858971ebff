"""The text features the writing rewards are built from."""

import pytest

from teamrl.rewards.text import (
    STOPWORDS,
    TRANSITION_CATEGORIES,
    char_length_ratio,
    content_jaccard,
    content_words,
    distinct_word_share,
    token_count,
    transition_categories,
    unique_word_ratio,
    unique_words,
    words,
)


def test_token_count_splits_on_any_whitespace_run():
    assert token_count("  one\ttwo\n\nthree  four,five ") == 4
    assert token_count("") == 0
    assert token_count(" \n\t") == 0


def test_words_lowercase_keep_contractions_and_split_on_punctuation():
    expected = ["don't", "stop", "loss", "2x", "café", "au", "lait"]
    assert words("Don't stop-loss 2x! Café_au LAIT") == expected
    assert words("It\u2019s") == ["it's"]
    assert words("... -- !!") == []


def test_unique_words_counts_each_spelling_once_case_insensitively():
    assert unique_words("The cat and THE Cat, the end.") == {"the", "cat", "and", "end"}


def test_distinct_word_share_is_unique_words_over_words():
    assert distinct_word_share("The cat and THE Cat, the end.") == 4 / 7  # {the, cat, and, end} of 7 words
    assert distinct_word_share("don't stop") == 1.0  # a contraction is one word
    assert distinct_word_share("... !!!") == 0.0


def test_unique_word_ratio_is_distinct_words_of_text_over_reference():
    assert unique_word_ratio("a b c d", "a a b b e f g h") == 6 / 4
    # Repetition does not add vocabulary.
    assert unique_word_ratio("a b", "a a a a a a") == 0.5


def test_unique_word_ratio_is_zero_when_reference_has_no_words():
    assert unique_word_ratio("... !!! ???", "plenty of words here") == 0.0


def test_char_length_ratio_uses_raw_lengths():
    assert char_length_ratio("abcd", "abcdefgh") == 2.0
    assert char_length_ratio("ab  ", "a") == 0.25  # whitespace counts as characters
    assert char_length_ratio("", "abc") == 0.0


def test_content_words_drop_stopwords_including_contractions():
    text = "The model doesn't learn, but it WILL improve"
    assert content_words(text) == {"model", "learn", "improve"}


def test_content_jaccard_hand_computed():
    # content(a) = {red, fox, jumps}, content(b) = {fox, jumps, high, fence}: 2 shared of 5.
    a, b = "The red fox jumps", "A fox jumps high over the fence"
    assert content_jaccard(a, b) == pytest.approx(2 / 5)
    assert content_jaccard("fox jumps", "The fox jumps") == 1.0
    assert content_jaccard("alpha beta", "gamma delta") == 0.0


def test_content_jaccard_is_symmetric_and_zero_without_content_words():
    a, b = "neural networks learn features", "features of networks"
    assert content_jaccard(a, b) == content_jaccard(b, a)
    assert content_jaccard("the and of", "it is a") == 0.0
    assert content_jaccard("", "") == 0.0


def test_stopwords_are_lowercase_single_words_in_tokenised_form():
    for stopword in STOPWORDS:
        assert words(stopword) == [stopword]


def test_every_phrase_matches_its_own_category_and_no_other():
    # Holds only if no phrase contains a phrase of another category: one phrase never counts twice.
    for category, phrases in TRANSITION_CATEGORIES.items():
        for phrase in phrases:
            assert transition_categories(phrase) == {category}, phrase


def test_enough_categories_for_the_transition_term_to_saturate():
    # T = 0.4 + 0.05 * (k - 1) reaches 1 at k = 13.
    assert len(TRANSITION_CATEGORIES) >= 13


def test_transition_matching_is_case_insensitive_and_spans_whitespace():
    assert transition_categories("HOWEVER, we went.") == {"contrast"}
    assert transition_categories("For\n  example, apples.") == {"example"}
    assert transition_categories("fruit, e.g. apples") == {"example"}


@pytest.mark.parametrize(
    "text",
    [
        "strengthen the wall",  # 'then' inside a word
        "a first-class result",  # 'first' in a hyphenated compound
        "the ifs and buts",  # plural nouns are not 'if' / 'but'
        "alsoran",
        "for the example",  # the words of 'for example' must be adjacent
    ],
)
def test_transition_matching_respects_word_boundaries(text):
    assert transition_categories(text) == frozenset()


def test_transition_categories_collects_each_category_once():
    text = "However, the plan failed. But we tried. For example, twice. Therefore we stopped."
    assert transition_categories(text) == {"contrast", "example", "cause_effect"}
