"""Cooperation schemes recognised on hand-written joint actions: each scheme, priorities, trivial cases."""

from __future__ import annotations

from textwrap import dedent

import pytest

from teamrl.envs.code_schemes import SCHEMES, classify_scheme, scheme_distribution

AUX = "def aux(xs):\n    return sorted(set(xs))\n"


def fenced(code: str, chatter: str = "Here is my solution:") -> str:
    """A markdown completion: chatter, the code in a python fence, more chatter."""
    return f"{chatter}\n\n```python\n{dedent(code).strip()}\n```\n\nThis handles all cases."


def scheme_of(main: str, aux: str = AUX, entry_point: str = "solve") -> str:
    return classify_scheme(aux, dedent(main), entry_point).scheme


# ----------------------------------------------------------------------------------------------
# One scheme each


FALLBACK = {
    "try_except": """
        def solve(xs):
            try:
                return aux(xs)
            except Exception:
                return sorted(set(xs))
        """,
    "none_check_then_own_computation": """
        def solve(xs):
            result = aux(xs)
            if result is None:
                result = sorted(set(xs))
            return result
        """,
    "early_return_then_own_computation": """
        def solve(xs):
            result = aux(xs)
            if result:
                return result
            seen = []
            for x in xs:
                if x not in seen:
                    seen.append(x)
            return sorted(seen)
        """,
    "or_own_computation": """
        def solve(xs):
            return aux(xs) or sorted(set(xs))
        """,
    "ternary_own_computation": """
        def solve(xs):
            r = aux(xs)
            return r if r is not None else list(dict.fromkeys(xs))
        """,
}

COORDINATOR = {
    "loop_over_parts": """
        def solve(groups):
            out = []
            for group in groups:
                out.append(aux(group))
            return out
        """,
    "comprehension": """
        def solve(text):
            return " ".join(aux(word) for word in text.split())
        """,
    "map": """
        def solve(words):
            return list(map(aux, words))
        """,
    "key_function": """
        def solve(words):
            return sorted(words, key=aux)
        """,
    "divide_and_combine": """
        def solve(xs):
            middle = len(xs) // 2
            return aux(xs[:middle]) + aux(xs[middle:])
        """,
}

STRATEGY_FILTER = {
    "if_on_aux": """
        def solve(xs):
            if aux(xs):
                return sorted(xs)
            return sorted(xs, reverse=True)
        """,
    "named_decision_in_ternary": """
        def solve(n):
            is_small = aux(n) < 10
            return n * 2 if is_small else n // 2
        """,
    "while_on_aux": """
        def solve(n):
            while aux(n):
                n -= 1
            return n
        """,
    "walrus_decision": """
        def solve(s):
            if (mode := aux(s)) == "upper":
                return s.upper()
            elif mode == "lower":
                return s.lower()
            return s
        """,
}

DECORATOR = {
    "guard_clause": """
        def solve(xs):
            \"\"\"Unique sorted values.\"\"\"
            if not xs:
                return []
            return aux(xs)
        """,
    "guard_clause_with_else": """
        def solve(xs, n):
            if n < 0:
                raise ValueError("n must be non-negative")
            elif n == 0:
                return []
            else:
                return aux(xs)
        """,
    "formatting": """
        def solve(xs):
            return ", ".join(str(x) for x in aux(xs))
        """,
    "post_processing_after_assignment": """
        def solve(s):
            words = aux(s)
            return words[0].upper()
        """,
    "f_string": """
        def solve(x):
            return f"{aux(x):.2f}"
        """,
    "edge_case_of_the_result": """
        def solve(xs):
            r = aux(xs)
            if r is None:
                return []
            return r
        """,
}

OTHER = {
    "preprocessed_arguments_only": """
        def solve(xs):
            return aux(sorted(xs))
        """,
    "result_thrown_away": """
        def solve(xs):
            aux(xs)
            return len(xs)
        """,
    "unrelated_statements_around_the_call": """
        def solve(xs):
            print("solving")
            result = aux(xs)
            return result
        """,
}


@pytest.mark.parametrize(("scheme", "main"), [(scheme, main) for scheme, cases in [
    ("fallback", FALLBACK), ("coordinator", COORDINATOR), ("strategy_filter", STRATEGY_FILTER),
    ("decorator", DECORATOR), ("other", OTHER)] for main in cases.values()],
    ids=[name for cases in (FALLBACK, COORDINATOR, STRATEGY_FILTER, DECORATOR, OTHER) for name in cases])
def test_each_scheme_is_recognised(scheme, main):
    result = classify_scheme(AUX, dedent(main), "solve")
    assert result.scheme == scheme, result.reasons
    assert result.matched[0] == scheme
    assert result.reasons and all(reason.startswith(f"{scheme}: ") for reason in result.reasons[:1])


@pytest.mark.parametrize(("scheme", "main"), [("fallback", FALLBACK["try_except"]),
                                              ("coordinator", COORDINATOR["comprehension"]),
                                              ("strategy_filter", STRATEGY_FILTER["if_on_aux"]),
                                              ("decorator", DECORATOR["guard_clause"]),
                                              ("other", OTHER["preprocessed_arguments_only"])])
def test_markdown_fenced_completions_are_recognised(scheme, main):
    aux = fenced(AUX, "Sure! The helper:")
    assert classify_scheme(aux, fenced(main), "solve").scheme == scheme
    unclosed = "Solution:\n```python\n" + dedent(main).strip() + "\n"  # the generation was cut off in the fence
    assert classify_scheme(aux, unclosed, "solve").scheme == scheme


def test_reasons_name_the_rule_and_the_line():
    result = classify_scheme(AUX, dedent(FALLBACK["try_except"]), "solve")
    assert result.reasons == ("fallback: try/except around aux (main line 2) with a handler that computes "
                              "its own result (main line 4)",)
    assert classify_scheme(AUX, dedent(COORDINATOR["map"]), "solve").reasons == (
        "coordinator: aux is handed to map(...) (main line 2), which applies it to many items",)


def test_a_custom_helper_name_is_followed():
    main = "def solve(xs):\n    return [helper(x) for x in xs]\n"
    helper = "def helper(x):\n    return x + 1\n"
    assert classify_scheme(helper, main, "solve", aux_name="helper").scheme == "coordinator"


# ----------------------------------------------------------------------------------------------
# Near misses: what a rule deliberately does not count


@pytest.mark.parametrize(("main", "scheme"), [
    # a handler that only re-raises, swallows or skips is no fallback path
    ("def solve(xs):\n    try:\n        return aux(xs)\n    except ValueError:\n        raise\n", "other"),
    ("def solve(xs):\n    try:\n        r = aux(xs)\n    except ValueError:\n        return None\n"
     "    return r\n", "other"),
    # a check on the result that returns a constant is an edge case, not a re-implementation
    ("def solve(xs):\n    r = aux(xs)\n    return r if r else []\n", "decorator"),
    # the same call twice (check, then answer) is not splitting the work
    ("def solve(xs):\n    if aux(xs) is None:\n        return sorted(xs)\n    return aux(xs)\n", "fallback"),
    # a rebinding of the parameter: the argument of aux is the input, not aux's result
    ("def solve(s):\n    s = aux(s)\n    return s.strip()\n", "decorator"),
    # the first iterable of a comprehension is evaluated once
    ("def solve(xs):\n    return [x * 2 for x in aux(xs)]\n", "decorator"),
    # a guard after aux was called is not a guard clause
    ("def solve(xs):\n    r = aux(xs)\n    if not xs:\n        return []\n    return r\n", "other"),
])
def test_near_misses(main, scheme):
    assert scheme_of(main) == scheme


# ----------------------------------------------------------------------------------------------
# Priority: several schemes match, the first in SCHEMES wins


def test_schemes_are_listed_in_priority_order():
    assert SCHEMES == ("trivial", "fallback", "coordinator", "strategy_filter", "decorator", "other")


@pytest.mark.parametrize(("main", "matched"), [
    # a try/except fallback per part of the input: fallback over coordinator
    ("""
     def solve(groups):
         out = []
         for group in groups:
             try:
                 out.append(aux(group))
             except TypeError:
                 out.append(sorted(group))
         return out
     """, ("fallback", "coordinator", "decorator")),
    # a fallback whose answer is post-processed: fallback over decorator
    ("""
     def solve(xs):
         if not xs:
             return []
         try:
             r = aux(xs)
         except Exception:
             r = sorted(set(xs))
         return list(r)
     """, ("fallback", "decorator")),
    # aux used as a per-item predicate in a loop: coordinator over strategy_filter
    ("""
     def solve(xs):
         kept = []
         for x in xs:
             if aux(x):
                 kept.append(x)
         return kept
     """, ("coordinator", "strategy_filter")),
    # a guard clause, then aux decides the branch: strategy_filter over decorator
    ("""
     def solve(xs):
         if not xs:
             return []
         if aux(xs):
             return sorted(xs)
         return xs
     """, ("strategy_filter", "decorator")),
    # a decision computed from aux's result is post-processing too: strategy_filter wins
    (STRATEGY_FILTER["named_decision_in_ternary"], ("strategy_filter", "decorator")),
    # several calls on parts, combined: coordinator over decorator
    (COORDINATOR["divide_and_combine"], ("coordinator", "decorator")),
])
def test_priority_picks_the_first_matching_scheme(main, matched):
    result = classify_scheme(AUX, dedent(main), "solve")
    assert result.matched == matched, result.reasons
    assert result.scheme == matched[0]
    assert [reason.split(":")[0] for reason in result.reasons] == sorted(
        (reason.split(":")[0] for reason in result.reasons), key=SCHEMES.index)


def test_trivial_wins_over_any_pattern_when_aux_is_empty():
    empty = "def aux(xs):\n    \"\"\"TODO.\"\"\"\n    pass\n"
    result = classify_scheme(empty, dedent(FALLBACK["try_except"]), "solve")
    assert (result.scheme, result.matched) == ("trivial", ("trivial",))
    assert result.reasons == ("trivial: aux is empty (only pass, ..., return None or raise NotImplementedError)",)


# ----------------------------------------------------------------------------------------------
# Trivial


@pytest.mark.parametrize(("aux", "main", "reason"), [
    (AUX, "def solve(xs):\n    return sorted(set(xs))\n", "main never calls aux"),
    (AUX, "def solve(xs):\n    def aux(v):\n        return v\n    return sorted(xs)\n", "main never calls aux"),
    (AUX, "def solve(xs):\n    \"\"\"Doc.\"\"\"\n    return aux(xs)\n", "main is a thin wrapper"),
    (AUX, "def solve(xs, reverse=False):\n    result = aux(xs, reverse=reverse)\n    return result\n",
     "main is a thin wrapper"),
    (AUX, fenced("def solve(xs):\n    return aux(xs)\n"), "main is a thin wrapper"),
    ("def aux(xs):\n    ...\n", DECORATOR["guard_clause"], "aux is empty"),
    ("def aux(xs):\n    return None\n", COORDINATOR["map"], "aux is empty"),
    ("def aux(xs):\n    raise NotImplementedError('later')\n", STRATEGY_FILTER["if_on_aux"], "aux is empty"),
    ("", COORDINATOR["map"], "the helper's code defines no function aux"),
    ("I cannot help with that.", COORDINATOR["map"], "the helper's code defines no function aux"),
    ("class aux:\n    pass\n", COORDINATOR["map"], "the helper's code defines no function aux"),
    ("def aux(xs):\n    return sorted(xs\n", COORDINATOR["map"], "aux does not parse"),
    (AUX, "", "main's code defines no function solve"),
    (AUX, "def solve(xs):\n    return [aux(x) for x in xs\n", "main's solve does not parse"),
])
def test_trivial_cases(aux, main, reason):
    result = classify_scheme(aux, dedent(main), "solve")
    assert result.scheme == "trivial"
    assert any(item.startswith(f"trivial: {reason}") for item in result.reasons), result.reasons


def test_every_trivial_reason_is_reported():
    result = classify_scheme("def aux(x):\n    pass\n", "def solve(x):\n    return x\n", "solve")
    assert result.reasons == ("trivial: aux is empty (only pass, ..., return None or raise NotImplementedError)",
                              "trivial: main never calls aux")


@pytest.mark.parametrize(("entry_point", "aux_name", "message"), [
    ("not an identifier", "aux", "entry_point must be a Python identifier"),
    ("solve", "", "aux_name must be a Python identifier"),
    ("aux", "aux", "entry_point and aux_name must differ"),
])
def test_bad_names_are_rejected(entry_point, aux_name, message):
    with pytest.raises(ValueError, match=message):
        classify_scheme(AUX, "def solve(xs):\n    return aux(xs)\n", entry_point, aux_name)


# ----------------------------------------------------------------------------------------------
# Distribution


def test_scheme_distribution_counts_fractions_over_all_schemes():
    pairs = [(AUX, dedent(FALLBACK["try_except"])), (AUX, dedent(COORDINATOR["map"])),
             (AUX, dedent(COORDINATOR["comprehension"])), (AUX, "def solve(xs):\n    return xs\n")]
    distribution = scheme_distribution(pairs, "solve")
    assert list(distribution) == list(SCHEMES)
    assert distribution == {"trivial": 0.25, "fallback": 0.25, "coordinator": 0.5, "strategy_filter": 0.0,
                            "decorator": 0.0, "other": 0.0}


def test_scheme_distribution_takes_one_entry_point_per_pair():
    pairs = [(AUX, "def first(xs):\n    return aux(xs) or sorted(set(xs))\n"),
             (AUX, "def second(xs):\n    return aux(xs)\n")]
    distribution = scheme_distribution(iter(pairs), ["first", "second"])
    assert distribution["fallback"] == 0.5 and distribution["trivial"] == 0.5
    assert sum(distribution.values()) == pytest.approx(1.0)


def test_scheme_distribution_rejects_bad_arguments_naming_them():
    with pytest.raises(ValueError, match="pairs must hold at least one"):
        scheme_distribution([], "solve")
    with pytest.raises(ValueError, match="entry_points must be one name or one per pair, got 1 for 2 pairs"):
        scheme_distribution([(AUX, ""), (AUX, "")], ["solve"])
