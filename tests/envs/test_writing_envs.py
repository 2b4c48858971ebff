"""The TLDR and arXiv writing environments: data sources, held-out splits, observations, joint and
individual rewards, and independent learners training on them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from teamrl.data import DataError
from teamrl.envs import ENVIRONMENTS, make_env
from teamrl.envs.writing import ELLIPSIS, ArxivEnv, TldrEnv, truncate
from teamrl.rewards.writing import arxiv_reward, tldr_reward
from teamrl.train import Trainer

POSTS = str(Path(__file__).parent / "data" / "posts.jsonl")

SHORT = "My landlord kept the whole deposit over carpet stains that my move-in photos already show."
DETAILED = (
    "First, the landlord kept the entire security deposit, claiming the carpet was stained when the tenant "
    "moved out. However, photos taken at move-in show exactly the same stains, because the damage predates "
    "the lease. Consequently, the tenant has evidence and can dispute the deduction; for example, a letter "
    "citing the photos, and finally small claims court, are realistic options."
)
BACKGROUND = " ".join(["Parsing matters because systems need structure, however earlier parsers were slow."] * 13)
METHODS = " ".join(["We train a neural classifier with dense features, so parsing becomes fast and accurate."] * 15)


def _ids(items):
    return {item["id"] for item in items}


def test_both_tasks_are_registered_two_agent_single_turn():
    assert ENVIRONMENTS["tldr"] is TldrEnv and ENVIRONMENTS["arxiv"] is ArxivEnv
    for cls in (TldrEnv, ArxivEnv):
        assert cls.num_agents == 2 and cls.max_turns == 1 and cls.max_reward == 3.0
        assert len(cls.roles) == 2 and all(cls.roles) and cls.roles[0] != cls.roles[1]


def test_tldr_from_a_local_file_holds_out_a_disjoint_eval_split():
    env = make_env("tldr", source=POSTS, eval_size=3, seed=1)
    train, evaluation = env.items("train"), env.items("eval")
    assert len(train) == 7 and len(evaluation) == 3
    assert _ids(train) | _ids(evaluation) == {f"p{i}" for i in range(1, 11)}
    assert _ids(train).isdisjoint(_ids(evaluation))
    assert set(train[0]) == {"id", "text"}
    again = make_env("tldr", source=POSTS, eval_size=3, seed=1)
    assert again.items("eval") == evaluation  # deterministic
    assert len(make_env("tldr", source=POSTS, eval_size=0.2, num_train=4).items("train")) == 4
    with pytest.raises(ValueError, match="split must be 'train' or 'eval'"):
        env.items("test")


def test_tldr_on_aclsum_uses_its_train_and_validation_splits():
    pytest.importorskip("aclsum")
    env = make_env("tldr")  # the offline default source
    train, evaluation = env.items("train"), env.items("eval")
    assert (len(train), len(evaluation)) == (100, 50)
    assert _ids(train).isdisjoint(_ids(evaluation))
    assert {item["text"] for item in train}.isdisjoint(item["text"] for item in evaluation)
    assert evaluation[0]["id"] == "2021.eacl-main.84"
    assert evaluation[0]["text"].startswith("Identifying named entities in written text")
    assert len(make_env("tldr", num_train=8, num_eval=4).items("eval")) == 4


def test_arxiv_on_aclsum_keeps_the_introduction_as_reference():
    pytest.importorskip("aclsum")
    env = make_env("arxiv", num_train=5, num_eval=5)
    item = env.items("eval")[0]
    assert set(item) == {"id", "text", "reference"}
    assert item["reference"].startswith("Automatically identifying named entities")
    assert _ids(env.items("train")).isdisjoint(_ids(env.items("eval")))


@pytest.mark.parametrize("task", ["tldr", "arxiv"])
def test_each_agent_sees_the_text_with_its_own_instructions(task):
    env = make_env(task, source=POSTS, eval_size=2)
    item = env.items("train")[0]
    observations = env.observe(item)
    assert len(observations) == 2 and observations[0] != observations[1]
    for observation, instruction in zip(observations, env.instructions):
        assert item["text"] in observation and observation.endswith(instruction)
    assert env.observe(item) == observations  # a function of the item only: no agent sees the other's output


def test_joint_reward_is_the_task_reward_with_its_levels():
    tldr = make_env("tldr", source=POSTS, eval_size=2)
    item = tldr.items("train")[0]
    result = tldr.joint_reward(item, [SHORT, DETAILED])
    assert result == tldr_reward(SHORT, DETAILED)
    assert set(result.parts) == {"length", "ratio", "unique_words", "transitions", "jaccard"}
    assert result.total > 2.0
    assert tldr.joint_reward(item, ["too short", DETAILED]).parts == {"length": 0.0}

    arxiv = make_env("arxiv", source=POSTS, eval_size=2)
    assert arxiv.joint_reward(item, [BACKGROUND, METHODS]) == arxiv_reward(BACKGROUND, METHODS)
    assert arxiv.joint_reward(item, [BACKGROUND, METHODS]).parts["length"] == 0.5
    with pytest.raises(ValueError, match="one completion per agent"):
        arxiv.joint_reward(item, [BACKGROUND])


def test_max_text_chars_cuts_long_texts():
    env = make_env("tldr", source=POSTS, eval_size=2, max_text_chars=60)
    texts = [item["text"] for item in env.items("train")]
    assert all(len(text) <= 60 and text.endswith(ELLIPSIS) for text in texts)
    assert env.observe(env.items("train")[0])[0].count(ELLIPSIS) == 1


def test_truncate_cuts_at_a_word_boundary():
    assert truncate("  short text  ", 50) == "short text"
    assert truncate("one two three four", None) == "one two three four"
    assert truncate("one two three four", 12) == "one two ..."  # 'thr' of 'three' is dropped
    assert truncate("one two three four", 11) == "one two ..."  # the cut falls right after 'two'
    assert truncate("abcdefghij", 8) == "abcd ..."  # a single word is cut inside
    assert all(len(truncate("alpha beta gamma delta", n)) <= n for n in range(5, 30))


def test_split_files_are_used_as_splits_and_eval_never_repeats_train(tmp_path):
    rows = {
        "train": [{"text": "alpha story"}, {"text": "beta story"}],
        "validation": [{"text": "beta story"}, {"text": "gamma story"}],
    }
    for split, records in rows.items():
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    env = make_env("tldr", source=str(tmp_path / "{split}.jsonl"))
    assert [i["id"] for i in env.items("train")] == ["train-0", "train-1"]
    assert [(i["id"], i["text"]) for i in env.items("eval")] == [("validation-1", "gamma story")]
    with pytest.raises(DataError, match="every eval item repeats a training item"):
        make_env("tldr", source=str(tmp_path / "{split}.jsonl"), eval_split="train")


def test_hub_source_reads_the_papers_dataset_and_splits(monkeypatch):
    datasets = pytest.importorskip("datasets")
    import teamrl.models.loading

    def fake_load_dataset(name, split):
        assert name == "trl-lib/tldr"
        rows = [{"prompt": f"{split} post {i}", "completion": f"tl;dr {i}"} for i in range(3)]
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(teamrl.models.loading, "hub_reachable", lambda: True)
    env = make_env("tldr", source="hub", num_train=2)
    assert env.source == "trl-lib/tldr"
    assert env.items("train") == [{"id": f"train-{i}", "text": f"train post {i}", "reference": f"tl;dr {i}"}
                                  for i in range(2)]
    assert [item["text"] for item in env.items("eval")] == ["test post 0", "test post 1", "test post 2"]


def test_hub_source_names_the_papers_dataset_and_the_local_fallback(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as on a machine without the hub extra
    for task, dataset in (("tldr", "trl-lib/tldr"), ("arxiv", "OpenMLRL/arXiv_abstract")):
        with pytest.raises(DataError, match=f"hub dataset '{dataset}'.*env.kwargs.source=/path/to/data.jsonl"):
            make_env(task, source="hub")


def test_configuration_errors_name_the_setting():
    with pytest.raises(ValueError, match=r"env.kwargs: 'tldr' does not accept these arguments .*'sorce'"):
        make_env("tldr", sorce=POSTS)
    with pytest.raises(DataError, match=r"record 0 has no field 'body' \(its fields: id, text, summary\); "
                                        r"set env.kwargs.text_field"):
        make_env("tldr", source=POSTS, text_field="body")
    with pytest.raises(DataError, match="has no field 'tldr'.*set env.kwargs.reference_field"):
        make_env("arxiv", source=POSTS, reference_field="tldr")
    with pytest.raises(DataError, match="no such file"):
        make_env("tldr", source="missing/posts.jsonl")
    with pytest.raises(DataError, match="env.kwargs.eval_size: .*leaves no records to train on"):
        make_env("tldr", source=POSTS, eval_size=10)
    for kwargs, name in (({"eval_size": 0}, "eval_size"), ({"num_train": 0}, "num_train"),
                         ({"max_text_chars": 3}, "max_text_chars")):
        with pytest.raises(ValueError, match=f"env.kwargs.{name}: must be"):
            make_env("tldr", source=POSTS, **kwargs)


def test_vocabulary_covers_every_observation_for_the_tiny_model():
    env = make_env("tldr", source=POSTS, eval_size=2)
    words = env.vocabulary()
    assert len(words) == len(set(words))
    observed = {token for item in [*env.items("train"), *env.items("eval")] for obs in env.observe(item)
                for token in obs.split()}
    assert observed <= set(words) and {"however", "finally"} <= set(words)


def test_duplicate_ids_and_empty_texts_are_rejected(tmp_path):
    duplicates = tmp_path / "dup.jsonl"
    duplicates.write_text('{"id": "a", "text": "x y"}\n{"id": "a", "text": "z w"}\n{"id": "b", "text": "v"}\n')
    with pytest.raises(DataError, match="id 'a' occurs twice; set env.kwargs.id_field"):
        make_env("tldr", source=str(duplicates), eval_size=1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": "fine"}\n{"text": "  "}\n')
    with pytest.raises(DataError, match="record 1 field 'text' is empty or not text"):
        make_env("tldr", source=str(empty), eval_size=1)


# --------------------------------------------------------------------------------------------------
# Individual rewards: the independent-learner baseline (algorithm.learners=individual)


def test_individual_rewards_score_each_agents_completion_alone():
    tldr = make_env("tldr", source=POSTS, eval_size=2)
    item = tldr.items("train")[0]
    # 8 words, 5 distinct {however, p0..p3}: length 0.5 + 0.5 * 5/8; transitions (contrast, T = 0.4)
    # count for the detailed summary only: + 0.4 * 0.4
    own = "however p0 p1 p2 p0 p1 p2 p3"
    assert tldr.individual_rewards(item, [own, own]) == pytest.approx([0.8125, 0.9725])
    assert tldr.individual_rewards(item, ["too short", own]) == pytest.approx([0.0, 0.9725])
    many = tldr.individual_rewards_many([(item, [own, own], ()), (item, [own, "x"], ())])
    assert many[0] == pytest.approx([0.8125, 0.9725]) and many[1] == pytest.approx([0.8125, 0.0])

    arxiv = make_env("arxiv", source=POSTS, eval_size=2)
    # 130 tokens, 65 distinct words each said twice: 0.5 + 0.5 * 0.5 + transitions (T = 0.4) for both agents
    long = " ".join(["however", *(f"w{i}" for i in range(64))] * 2)
    assert arxiv.individual_rewards(item, [long, long]) == pytest.approx([0.91, 0.91])
    assert arxiv.individual_rewards(item, [long, own]) == pytest.approx([0.91, 0.0])  # 8 tokens < 128
    with pytest.raises(ValueError, match="one completion per agent"):
        arxiv.individual_rewards(item, [own])


@pytest.mark.slow
@pytest.mark.parametrize("task", ["tldr", "arxiv"])
def test_independent_learners_train_on_the_writing_tasks(task, tiny_config):
    config = tiny_config(env={"name": task, "kwargs": {"source": POSTS, "eval_size": 2}},
                         team={"sampling": {"max_new_tokens": 12}}, algorithm={"num_generations": 2,
                                                                              "learners": "individual"},
                         items_per_step=2, steps=2)
    history = Trainer(config).train()
    assert [metrics["step"] for metrics in history] == [1, 2]
    assert all(metrics["loss"] == metrics["loss"] for metrics in history)  # finite, not NaN


# --------------------------------------------------------------------------------------------------
# Several turns: each agent revises its part after feedback on the pair


@pytest.mark.parametrize(("c1", "c2", "summary_told", "detailed_told"), [
    ("Too short.", DETAILED, "Your one-sentence summary has 2 words; it needs 8 to 256.",
     "Your detailed summary's length (59 words) is fine; the one-sentence summary is not."),
    (SHORT, SHORT + " It was unfair.",
     "The detailed summary is 1.2 times as long as the one-sentence summary; it should be 1.6 to 3.2 times as "
     "long. Make yours shorter.",
     "The detailed summary is 1.2 times as long as the one-sentence summary; it should be 1.6 to 3.2 times as "
     "long. Write more."),
    (SHORT, " ".join([SHORT] * 2) + " Really.",
     "The detailed summary uses 1.1 times as many different words as the one-sentence summary; it should use at "
     "least 2 times as many. Use fewer, plainer words.",
     "The detailed summary uses 1.1 times as many different words as the one-sentence summary; it should use at "
     "least 2 times as many. Use more varied words."),
])
def test_feedback_names_the_first_level_the_pair_fails_in_numbers(c1, c2, summary_told, detailed_told):
    from teamrl.rewards.writing import TLDR_SPEC, writing_feedback

    names = TldrEnv.output_names
    assert writing_feedback(TLDR_SPEC, c1, c2, names) == (summary_told, detailed_told)


def test_feedback_past_the_gates_says_what_is_left_to_gain_to_whom():
    from teamrl.rewards.writing import TLDR_SPEC, writing_feedback

    detailed = ("The landlord kept my deposit for carpet stains. However, my move-in photos show the same stains, "
                "so the damage came before me. As a result, I can dispute it with a letter and small claims court.")
    result = tldr_reward(SHORT, detailed)
    assert result.parts["jaccard"] == 0.6 and result.parts["transitions"] < 0.4  # two transition kinds only
    # TLDR looks for transitions in the detailed summary alone: only its writer is told to add them.
    assert writing_feedback(TLDR_SPEC, SHORT, detailed, TldrEnv.output_names) == (
        "Your part fits; keep it as it is.",
        "The lengths and wording fit. To improve, link ideas with more kinds of transition words such as first, "
        "because, however, for example, as a result, finally (2 kinds so far).")


def test_a_later_turn_shows_each_agent_both_answers_and_its_own_feedback():
    from teamrl.envs.base import Step

    env = TldrEnv(POSTS, eval_size=2, turns=2)
    item = env.items("eval")[0]
    first = (SHORT, SHORT + " It was unfair.")
    summary_seen, detailed_seen = env.next_observations(item, [Step(tuple(env.observe(item)), first,
                                                                    env.joint_reward(item, first))])
    assert summary_seen.startswith(env.observe(item)[0])
    assert f"Your one-sentence summary:\n{first[0]}" in summary_seen
    assert f"Your teammate's detailed summary:\n{first[1]}" in summary_seen
    assert "Make yours shorter." in summary_seen and "Write more." in detailed_seen
    assert detailed_seen.endswith("Write your detailed summary again, improved, and nothing else.")


def test_a_sparse_episode_is_scored_at_its_last_turn_only():
    from teamrl.envs.base import Step

    env = TldrEnv(POSTS, eval_size=2, turns=2, sparse=True)
    item = env.items("eval")[0]
    pair = (SHORT, DETAILED)
    assert env.joint_reward(item, pair).total == 0.0 and env.individual_rewards(item, pair) == [0.0, 0.0]
    step = Step(tuple(env.observe(item)), pair, env.joint_reward(item, pair))
    assert env.joint_reward(item, pair, [step]) == tldr_reward(*pair)
    with pytest.raises(ValueError, match=r"algorithm\.num_turns: sparse: true pays only at turn env\.kwargs\.turns "
                                         r"= 2, so a 1-turn episode earns 0 everywhere"):
        env.check_num_turns(1)
    with pytest.raises(ValueError, match=r"env\.kwargs\.sparse: a sparse reward pays the last of several turns"):
        TldrEnv(POSTS, eval_size=2, sparse=True)
    with pytest.raises(ValueError, match=r"algorithm\.num_turns: TldrEnv supports at most 2 turns"):
        env.check_num_turns(3)


def test_a_two_turn_writing_team_trains(tiny_config):
    config = tiny_config(env={"name": "tldr", "kwargs": {"source": POSTS, "eval_size": 2, "turns": 2}},
                         team={"training": "lora", "sampling": {"max_new_tokens": 6}},
                         algorithm={"num_generations": 2, "num_turns": 2}, items_per_step=1, steps=1)
    with Trainer(config) as trainer:
        metrics = trainer.train_step()
    assert metrics["turn2/joint_actions"] == 4.0 and "reward/episode/mean" in metrics


def test_keep_holds_an_agents_earlier_text_for_the_reward_and_its_teammate():
    from teamrl.envs.base import Step

    env = TldrEnv(POSTS, eval_size=2, turns=3, keep=True)
    item = env.items("eval")[0]
    first = (SHORT, DETAILED)
    assert "write only KEEP" in env.next_observations(item, [Step(tuple(env.observe(item)), first,
                                                                  env.joint_reward(item, first))])[1]
    # At the first turn KEEP is just a (too short) text; after it, it holds the earlier text, turn after turn.
    assert env.joint_reward(item, ("KEEP", DETAILED)) == tldr_reward("KEEP", DETAILED)
    history = [Step(tuple(env.observe(item)), first, env.joint_reward(item, first))]
    kept = (" keep. ", "A new detailed summary that is too short.")
    assert env.held_texts(kept, history) == (SHORT, "A new detailed summary that is too short.")
    assert env.joint_reward(item, kept, history) == tldr_reward(SHORT, "A new detailed summary that is too short.")
    assert env.individual_rewards(item, ("KEEP", "Keep!"), history) == [
        result.total for result in TldrEnv.agent_rewards(*first)]
    history.append(Step(tuple(env.observe(item)), kept, env.joint_reward(item, kept, history)))
    assert env.held_texts(("KEEP", "KEEP"), history) == (SHORT, "A new detailed summary that is too short.")
    third = env.next_observations(item, history)[0]
    assert f"Your one-sentence summary:\n{SHORT}" in third and "KEEP\n" not in third
    # "KEEP" inside a longer answer is a new text; without keep, KEEP is a text at every turn.
    assert env.held_texts(("KEEP it short.", "KEEP"), history[:1])[0] == "KEEP it short."
    assert TldrEnv(POSTS, eval_size=2, turns=2).held_texts(("KEEP", "KEEP"), history[:1]) == ("KEEP", "KEEP")
    with pytest.raises(ValueError, match=r"env\.kwargs\.keep: KEEP holds a text from an earlier turn"):
        TldrEnv(POSTS, eval_size=2, keep=True)


def test_without_feedback_a_later_turn_shows_both_answers_and_nothing_else():
    from teamrl.envs.base import Step

    with_feedback, without = (TldrEnv(POSTS, eval_size=2, turns=2, feedback=flag) for flag in (True, False))
    item = with_feedback.items("eval")[0]
    history = [Step(tuple(with_feedback.observe(item)), (SHORT, DETAILED), with_feedback.joint_reward(
        item, (SHORT, DETAILED)))]
    for shown, hidden in zip(with_feedback.next_observations(item, history), without.next_observations(item, history)):
        feedback = shown[shown.index("Feedback: "):shown.index("Write your")]
        assert feedback.strip() and shown.replace(feedback, "") == hidden
