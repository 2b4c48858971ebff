"""The coding environments: problems offline, grading through the real sandbox, multi-turn feedback,
hostile joint actions, and training a tiny team on them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from teamrl.envs import Step, make_env
from teamrl.envs.coding import assertion_label, split_tests
from teamrl.rewards.code_extract import extract_code
from teamrl.sandbox import SandboxUnavailableError
from teamrl.train import Trainer

DATA = Path(__file__).parent / "data"
FAST_LIMITS = {"test_timeout_s": 1.0, "program_timeout_s": 3.0, "cpu_time_s": 1, "memory_bytes": 256 << 20}

# HumanEval/0, has_close_elements(numbers, threshold): whether two numbers are closer than threshold.
SORTING_AUX = "```python\ndef aux(numbers, threshold):\n    return sorted(numbers)\n```"
MAIN_WITH_AUX = (
    "Here is my function:\n```python\ndef has_close_elements(numbers, threshold):\n"
    "    ordered = aux(numbers, threshold)\n"
    "    return any(b - a < threshold for a, b in zip(ordered, ordered[1:]))\n```"
)
MAIN_ALONE = (
    "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n    ordered = sorted(numbers)\n"
    "    return any(b - a < threshold for a, b in zip(ordered, ordered[1:]))\n"
)
WRONG_MAIN = MAIN_WITH_AUX.replace("b - a < threshold", "b - a > threshold")
CALLING_MAIN = "def has_close_elements(numbers, threshold):\n    return bool(aux(numbers, threshold))\n"
HOSTILE_AUX = {
    "infinite loop": "def aux(numbers, threshold):\n    while True:\n        pass\n",
    "os._exit": "import os\n\ndef aux(numbers, threshold):\n    os._exit(0)\n",
    "fork bomb": "import os\n\ndef aux(numbers, threshold):\n    while True:\n        os.fork()\n",
    "kills the sandbox on load":
        "import os\n\ndef aux(numbers, threshold, _=os.kill(-1, 9)):\n    return numbers\n",
}

needs_bubblewrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture(scope="module")
def humaneval():
    env = make_env("humaneval", sandbox_workers=2, sandbox_limits=FAST_LIMITS)
    yield env
    env.close()


def _problem(env, problem_id):
    return next(item for split in ("train", "eval") for item in env.items(split) if item["id"] == problem_id)


# ------------------------------------------------------------------------------------------------
# Problems and observations


def test_humaneval_loads_164_problems_offline_split_into_disjoint_train_and_eval(humaneval):
    train, evaluation = humaneval.items("train"), humaneval.items("eval")
    assert (len(train), len(evaluation)) == (132, 32)
    ids = [item["id"] for item in [*evaluation, *train]]
    assert ids == [f"HumanEval/{i}" for i in range(164)]  # eval is the paper's test[:32], train the rest
    assert [item["id"] for item in make_env("humaneval").items("train")] == ids[32:]
    sliced = make_env("humaneval", start=10, limit=5, eval_size=2)
    assert [item["id"] for item in sliced.items("eval")] == ["HumanEval/10", "HumanEval/11"]
    assert [item["id"] for item in sliced.items("train")] == ["HumanEval/12", "HumanEval/13", "HumanEval/14"]


def test_items_hold_tests_labels_and_the_prompts_helpers(humaneval):
    first = _problem(humaneval, "HumanEval/0")
    assert first["entry_point"] == "has_close_elements" and first["parameters"] == "numbers, threshold"
    assert first["preamble"] == "from typing import List\n"
    # 7 asserts, none of them in the prompt: every third is shown (the 3rd and 6th), the other 5 held
    assert len(first["tests"]) == 5 and len(first["shown_tests"]) == len(first["shown_test_labels"]) == 2
    assert first["shown_test_labels"] == ["assert has_close_elements([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True",
                                          "assert has_close_elements([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True"]
    assert not set(first["tests"]) & set(first["shown_tests"])
    zero = _problem(humaneval, "HumanEval/32")
    assert "def poly(xs: list, x: float):" in zero["preamble"] and "def find_zero" not in zero["preamble"]


def test_tests_the_problem_shows_are_never_held():
    problem = "def f(xs, k):\n    \"\"\"\n    >>> f([1, 2], 'a')\n    3\n    \"\"\"\n"
    labels = ["assert f([1,2], \"a\") == 3",  # the prompt's example, spaces and quotes aside
              "assert f([1, 2], 'b') == 4", "assert f([3], 'a') == 3", "assert f([4], 'a') == 4",
              "assert f([1, 2], 'a') + f([5], 'a') == 8",  # only one of its calls is in the prompt
              "assert g([1, 2], 'a') == 3"]  # not a call of the entry point
    shown, held = split_tests(labels, problem, "f")
    assert shown == [0, 3] and held == [1, 2, 4, 5]  # public, then every third of the rest (labels 1-5)
    assert split_tests(labels[:1], problem, "f") == ([0], [0])  # every test public: nothing else can grade
    assert split_tests(labels[1:3], problem, "f") == ([], [0, 1])
    # A test that only repeats a shown test's call is shown too (its answer was in the feedback).
    repeats = [*labels[1:4], "assert f([4], 'a') > 0", "assert f([7], 'a') == 7"]
    assert split_tests(repeats, problem, "f") == ([2, 3], [0, 1, 4])


def test_observations_differ_per_agent_and_contain_the_prompt(humaneval):
    item = _problem(humaneval, "HumanEval/0")
    helper, main = humaneval.observe(item)
    assert helper != main
    for observation in (helper, main):
        assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in observation
        assert "any two numbers closer to each other" in observation
    assert "Write a helper function `aux(numbers, threshold)`" in helper
    assert "Implement `has_close_elements(numbers, threshold)`" in main and "Do not define `aux`" in main
    assert humaneval.roles[0] != humaneval.roles[1] and "```python" in humaneval.roles[1]


def test_vocabulary_lets_the_tiny_model_write_python_and_the_problems_names(humaneval):
    words = humaneval.vocabulary()
    assert {"def", "aux", "return", "```python", "has_close_elements", "threshold", "find_zero"} <= set(words)
    assert len(words) == len(set(words))


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match=r"env.kwargs.eval_size: .* must be in 1..3 \(got 4\)"):
        make_env("humaneval", limit=4, eval_size=4)
    with pytest.raises(ValueError, match="env.kwargs.sandbox_limits: .*'wall_s'"):
        make_env("humaneval", limit=4, eval_size=1, sandbox_limits={"wall_s": 1})
    with pytest.raises(ValueError, match="env.kwargs: 'mbpp' does not accept"):
        make_env("mbpp", path="x.jsonl")
    with pytest.raises(ValueError, match="split must be 'train' or 'eval'"):
        make_env("humaneval", limit=4, eval_size=1).items("test")


def test_without_bubblewrap_the_sandbox_refuses_unless_allowed(monkeypatch):
    def missing():
        raise SandboxUnavailableError("bubblewrap (`bwrap`) was not found on PATH")

    monkeypatch.setattr("teamrl.sandbox.runner.find_bubblewrap", missing)
    env = make_env("humaneval", limit=2, eval_size=1)
    with pytest.raises(SandboxUnavailableError, match="bwrap"):
        env.joint_reward(env.items("train")[0], ("", "def separate_paren_groups(s):\n    return []\n"))
    unsandboxed = make_env("humaneval", limit=2, eval_size=1, allow_unsandboxed=True)
    assert unsandboxed.pool.sandboxed is False
    unsandboxed.close()


# ------------------------------------------------------------------------------------------------
# Grading in the sandbox


@needs_bubblewrap
def test_joint_actions_score_what_the_code_reward_says(humaneval):
    item = _problem(humaneval, "HumanEval/0")
    team, alone, garbage = humaneval.joint_rewards(
        [(item, (SORTING_AUX, MAIN_WITH_AUX), ()), (item, ("", MAIN_ALONE), ()), (item, ("hello", "world"), ())])
    # aux sorts, main compares the gaps with its own threshold: credited on 4 held tests of 5 through the
    # swaps of the numbers; on the 5th every swap's answer is False, the other bool, which a main that
    # flips its own answer whenever aux disagrees would give too (teamrl.rewards.code, "Cooperation").
    assert team.total == pytest.approx(1.5 + 1.0 + 1.5 * 4 / 5) and humaneval.max_reward == 4.0
    assert team.counts["tests_passed"] == team.counts["tests_total"] == 5.0  # the held tests
    assert team.counts["shown_tests_passed"] == team.counts["shown_tests_total"] == 2.0
    # main alone: structure 0.6 + syntax 0.5 + tests 1.0, no helper and no cooperation
    assert alone.total == pytest.approx(2.1)
    assert alone.parts["aux_structure"] == 0.0 and alone.parts["tests"] == 1.0
    assert garbage.total == 0.0 and "tests_total" not in garbage.parts


@needs_bubblewrap
def test_the_prompts_helpers_let_a_main_that_defines_only_the_entry_point_pass(humaneval):
    item = _problem(humaneval, "HumanEval/32")  # find_zero's tests call poly, which only the prompt defines
    main = extract_code(item["reference"]).definition("find_zero").source
    assert [definition.name for definition in extract_code(main).definitions] == ["find_zero"]
    assert humaneval.joint_reward(item, ("", main)).parts["tests"] == 1.0


@needs_bubblewrap
def test_a_batch_grade_is_cached_with_its_full_record(humaneval):
    item = _problem(humaneval, "HumanEval/0")
    (reward,) = humaneval.joint_rewards([(item, (SORTING_AUX, WRONG_MAIN), ())])
    grade = humaneval.grade(item, (SORTING_AUX, WRONG_MAIN))
    assert grade.reward.total == reward.total and grade.record.total == 5 and grade.shown_record.total == 2
    assert grade is humaneval.grade(item, [SORTING_AUX, WRONG_MAIN])  # no second run
    assert [outcome.passed for outcome in grade.record.tests] == [True, False, False, True, False]
    assert grade.reward.parts["tests"] == pytest.approx(2 / 5)


@needs_bubblewrap
def test_hostile_joint_actions_are_contained_and_the_rest_of_the_batch_is_graded(humaneval):
    item = _problem(humaneval, "HumanEval/0")
    batch = [(SORTING_AUX, MAIN_WITH_AUX), *((aux, CALLING_MAIN) for aux in HOSTILE_AUX.values()), ("", MAIN_ALONE)]
    results = humaneval.joint_rewards([(item, actions, ()) for actions in batch])
    assert results[0].total == pytest.approx(3.7) and results[-1].total == pytest.approx(2.1)
    for name, result in zip(HOSTILE_AUX, results[1:-1]):
        assert result.parts["tests"] == 0.0, name
        assert result.counts["tests_total"] == 5.0, name
    records = {name: humaneval.grade(item, (aux, CALLING_MAIN)).record for name, aux in HOSTILE_AUX.items()}
    assert records["infinite loop"].timed_out
    assert records["os._exit"].tests[0].error_type == "NoResult"
    assert records["kills the sandbox on load"].status == "aborted"
    # The sandbox is still usable afterwards.
    assert humaneval.joint_reward(item, ("", MAIN_ALONE.replace("ordered", "xs"))).total == pytest.approx(2.1)


# ------------------------------------------------------------------------------------------------
# Individual rewards: the independent-learner baseline (algorithm.learners=individual)


@needs_bubblewrap
def test_individual_rewards_are_each_agents_own_parts(humaneval):
    item = _problem(humaneval, "HumanEval/0")
    batch = [(SORTING_AUX, MAIN_WITH_AUX), ("", MAIN_ALONE), ("hello", "world"), (SORTING_AUX, WRONG_MAIN)]
    rewards = humaneval.individual_rewards_many([(item, actions, ()) for actions in batch])
    assert rewards[0] == pytest.approx([0.9, 2.1])          # helper 0.4 + 0.5 ; main 0.6 + 0.5 + 5/5
    assert rewards[1] == pytest.approx([0.0, 2.1])          # no aux: the helper's gate; main alone passes all
    assert rewards[2] == pytest.approx([0.0, 0.0])          # no code at all
    assert rewards[3] == pytest.approx([0.9, 1.1 + 2 / 5])  # main passes 2 of 5 held tests of the joined program
    assert humaneval.individual_rewards(item, batch[3]) == rewards[3]


@needs_bubblewrap
def test_individual_rewards_reuse_the_joint_grading_and_run_nothing_twice(humaneval, monkeypatch):
    item = _problem(humaneval, "HumanEval/1")
    requests = [(item, (SORTING_AUX, f"def separate_paren_groups(paren_string):\n    return [{g}]\n"), ())
                for g in ("'()'", "aux(paren_string)", "'(())'")]
    submitted = []
    real_submit = humaneval.pool.submit
    monkeypatch.setattr(humaneval.pool, "submit", lambda program: submitted.append(program) or real_submit(program))
    humaneval.joint_rewards(requests)
    assert len(submitted) == 6  # each joint action's held tests and, in a sandbox of their own, its shown ones
    humaneval.individual_rewards_many(requests)  # what the rollout does next, for learners=individual
    assert len(submitted) == 6


# ------------------------------------------------------------------------------------------------
# Feedback between turns


def _next(env, item, actions):
    step = Step(tuple(env.observe(item)), tuple(actions), env.joint_reward(item, actions))
    return env.next_observations(item, [step])


def test_feedback_gives_syntax_errors_and_undefined_names_of_each_agents_own_code(humaneval):
    item = _problem(humaneval, "HumanEval/0")
    broken_aux = "```python\ndef aux(numbers, threshold):\n    return sorted(numbers\n```"
    main = "def has_close_elements(numbers, threshold):\n    return closest_pair(aux(numbers, threshold)) < threshold\n"
    helper_obs, main_obs = _next(humaneval, item, (broken_aux, main))
    assert helper_obs.startswith(humaneval.observe(item)[0])  # the original task comes first
    shown = "Your previous answer:\n```python\ndef aux(numbers, threshold):\n    return sorted(numbers\n```"
    assert shown in helper_obs
    assert "SyntaxError at line 2, column" in helper_obs and "closest_pair" not in helper_obs
    assert "line 2, column 12: name 'closest_pair' is not defined" in main_obs
    assert "name 'aux'" not in main_obs and "sorted(numbers" not in main_obs  # aux is known; no partner code
    for observation in (helper_obs, main_obs):
        assert "Tests were not run: the team's combined code does not parse." in observation
    assert helper_obs.endswith("reply with the improved `aux` in one ```python block.")
    assert main_obs.endswith("reply with the improved `has_close_elements` in one ```python block.")


@needs_bubblewrap
def test_feedback_details_failed_shown_tests_and_says_nothing_of_the_held_ones(humaneval):
    item = _problem(humaneval, "HumanEval/0")
    negated = MAIN_WITH_AUX.replace("return any(", "return not any(")
    helper_obs, main_obs = _next(humaneval, item, (SORTING_AUX, negated))
    for observation in (helper_obs, main_obs):
        assert ("Tests shown to you: 2 of 2 tests failed:\n"
                "- assert has_close_elements([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True\n"
                "  expected: True\n  actual:   False") in observation
        assert "\nHidden tests grade the team; nothing of them is shown, not even how many passed.\n" in observation
        assert "of 5" not in observation  # not even a count: a count is an oracle across turns
        # Nothing of a held test: neither its arguments nor its expected value.
        for held in item["tests"]:
            call = assertion_label(held, "has_close_elements").removeprefix("assert ").split(" == ")[0]
            assert call not in observation
    assert "return not any(" in main_obs and "return not any(" not in helper_obs


def test_feedback_on_missing_functions_and_an_unused_helper(humaneval):
    item = _problem(humaneval, "HumanEval/0")
    helper_obs, main_obs = _next(humaneval, item, ("I would sort the numbers first.", "def helper(x):\n    return x\n"))
    assert "Your previous answer:\nI would sort the numbers first." in helper_obs
    assert "- No Python function definition was found in your answer." in helper_obs
    assert "- Your code does not define the function `has_close_elements`." in main_obs
    assert "Tests were not run: the team's code has no function `has_close_elements`." in main_obs
    lazy = "def aux(numbers, threshold):\n    print(numbers)\n"
    helper_obs, main_obs = _next(humaneval, item, (lazy, "def has_close_elements(numbers, threshold):\n    return"))
    assert "- `aux` does not return a value." in helper_obs
    assert "- `has_close_elements` does not call the helper `aux`." in main_obs


# ------------------------------------------------------------------------------------------------
# MBPP and CoopHumanEval from local files


@needs_bubblewrap
def test_mbpp_from_a_local_jsonl():
    env = make_env("mbpp", source=str(DATA / "coding_mbpp.jsonl"), eval_size=1, sandbox_limits=FAST_LIMITS)
    assert [item["id"] for item in env.items("eval")] == ["2"]
    assert [item["entry_point"] for item in env.items("train")] == ["count_primes", "max_chain_length"]
    primes, chain = env.items("train")
    assert primes["parameters"] == "xs" and chain["preamble"] == "import math"
    assert "Write a function to count the prime numbers" in env.observe(primes)[1]
    assert "assert max_chain_length([Pair(5, 24)" in env.observe(chain)[0]  # the tests show the Pair class
    helper = "def aux(n):\n    return n > 1 and all(n % d for d in range(2, n))\n"
    main = "def count_primes(xs):\n    return sum(1 for x in xs if aux(x))\n"
    requests = [(item, ("", item["reference"]), ()) for item in env.items("train")] + [(primes, (helper, main), ())]
    rewards = env.joint_rewards(requests)
    assert [r.parts["tests"] for r in rewards] == [1.0, 1.0, 1.0]
    # main calls aux once per item, and no two tests' lists are as long: aux's answers to another test
    # never fit main's calls, so the swaps cannot show main building on them (teamrl.rewards.code)
    assert rewards[-1].total == pytest.approx(2.5)
    # individual: no helper code -> 0 ; the reference main 0.6 + 0.5 + 1.0 ; the full team 0.9 and 2.1
    individual = env.individual_rewards_many(requests)
    for own, expected in zip(individual, ([0.0, 2.1], [0.0, 2.1], [0.9, 2.1])):
        assert own == pytest.approx(expected)
    env.close()


@needs_bubblewrap
def test_coophumaneval_from_a_local_jsonl():
    env = make_env("coophumaneval", source=str(DATA / "coding_coophumaneval.jsonl"), eval_size=1,
                   sandbox_limits=FAST_LIMITS)
    assert [item["id"] for item in env.items("eval")] == ["CoopHumanEval/0"]
    assert [item["entry_point"] for item in env.items("train")] == ["shout_words", "digit_root"]
    items = [*env.items("eval"), *env.items("train")]
    rewards = env.joint_rewards([(item, ("", item["reference"]), ()) for item in items])
    assert [r.total for r in rewards] == pytest.approx([2.1, 2.1, 2.1])
    # individual: a helper whose aux returns and parses 0.9 (it is not called), or none 0; main solves
    # each problem alone: 0.6 + 0.5 + 1.0
    aux = "def aux(text):\n    return text.split()\n"
    assert env.individual_rewards(items[0], (aux, items[0]["reference"])) == pytest.approx([0.9, 2.1])
    assert env.individual_rewards(items[1], ("", items[1]["reference"])) == pytest.approx([0.0, 2.1])
    env.close()


def test_bad_records_are_reported_with_their_file_and_position(tmp_path):
    path = tmp_path / "coding_bad.jsonl"
    record = {"task_id": 7, "text": "Add.", "code": "def add(a, b):\n    return a + b\n",
              "test_list": ["assert sub(1, 2) == -1"]}
    path.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r"coding_bad.jsonl: record 0 \(7\): no function defined in its code"):
        make_env("mbpp", source=str(path), eval_size=1)
    path.write_text(json.dumps({**record, "test_list": "assert add(1, 2) == 3"}) + "\n")
    with pytest.raises(ValueError, match=r"coding_bad.jsonl: record 0 \(7\): test_list must be a non-empty list"):
        make_env("mbpp", source=str(path), eval_size=1)
    fixed = {**record, "test_list": ["assert add(1, 2) == 3"], "test_setup_code": "import (\n"}
    path.write_text(json.dumps(fixed) + "\n")
    with pytest.raises(ValueError, match=r"coding_bad.jsonl: record 0 \(7\): unusable test_setup_code"):
        make_env("mbpp", source=str(path), eval_size=1)
    good = json.loads((DATA / "coding_coophumaneval.jsonl").read_text().splitlines()[0])
    path.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "x", "test": "y"}) + "\n")
    with pytest.raises(ValueError, match="record 1 has no field 'entry_point'"):
        make_env("humaneval", source=str(path), eval_size=1)


# ------------------------------------------------------------------------------------------------
# Training a tiny team


def _tiny_coding_config(tiny_config, **overrides):
    return tiny_config(env={"name": "humaneval", "kwargs": {"limit": 2, "eval_size": 1, "sandbox_limits": FAST_LIMITS}},
                       algorithm={"num_generations": 2, "num_turns": 2}, items_per_step=1, steps=2,
                       logging={"sample_every": 1, "progress_bar": False},
                       team={"sampling": {"max_new_tokens": 16}}, **overrides)


@pytest.mark.slow
@needs_bubblewrap
@pytest.mark.parametrize(("task", "kwargs"), [
    ("humaneval", {"limit": 2}),
    ("coophumaneval", {"source": str(DATA / "coding_coophumaneval.jsonl")}),
    ("mbpp", {"source": str(DATA / "coding_mbpp.jsonl")}),
])
def test_independent_learners_train_on_the_coding_tasks(task, kwargs, tiny_config):
    config = tiny_config(env={"name": task, "kwargs": {**kwargs, "eval_size": 1, "sandbox_limits": FAST_LIMITS}},
                         algorithm={"num_generations": 2, "learners": "individual"}, items_per_step=1, steps=2,
                         team={"sampling": {"max_new_tokens": 16}})
    trainer = Trainer(config)
    history = trainer.train()
    trainer.env.close()
    assert [metrics["step"] for metrics in history] == [1, 2]
    assert all(metrics["loss"] == metrics["loss"] for metrics in history)  # finite, not NaN


@pytest.mark.slow
def test_two_turn_training_on_the_tiny_model_logs_the_feedback(tiny_config):
    config = _tiny_coding_config(tiny_config)
    history = Trainer(config).train()
    assert len(history) == 2 and "reward/turn2/mean" in history[-1]
    logged = [json.loads(line) for line in (Path(config.run_dir) / "samples.jsonl").read_text().splitlines()]
    second_turn = [sample for step in logged for sample in step["samples"] if sample["turn"] == 2]
    assert second_turn
    for sample in second_turn:
        helper_obs, main_obs = sample["observations"]
        assert "separate_paren_groups" in helper_obs and "Feedback on your previous answer:" in helper_obs
        assert "Tests were not run" in main_obs or "failed" in main_obs


@pytest.mark.slow
@needs_bubblewrap
def test_training_keeps_going_after_a_step_of_hostile_generations(tiny_config, monkeypatch):
    trainer = Trainer(_tiny_coding_config(tiny_config))
    entry_point = trainer.items[0]["entry_point"]
    real_sample = trainer.agents.sample

    def hostile_sample(observations, num_samples, seed):
        generations = real_sample(observations, num_samples, seed)
        main = f"def {entry_point}(text):\n    return aux(text, 0)\n"
        for name, generation in zip(trainer.agent_names, generations):
            code = HOSTILE_AUX["fork bomb"] if name == "first" else main
            generation.texts = [code] * len(generation.texts)
        return generations

    with monkeypatch.context() as patch:
        patch.setattr(trainer.agents, "sample", hostile_sample)
        hostile = trainer.train_step()
    # main defined (0.6) + parses (0.5), no test passes, aux returns nothing: in both turns
    assert hostile["reward/turn1/mean"] == pytest.approx(1.1) and hostile["reward/turn2/mean"] == pytest.approx(1.1)
    normal = trainer.train_step()
    assert normal["step"] == 2 and normal["loss"] == normal["loss"]  # finite, not NaN
