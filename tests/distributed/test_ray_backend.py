"""The Ray backend: a 2-agent team whose agents are Ray actors (fractional CPUs on a local Ray) trains to
the same numbers as the single-process run with the same seed, and its checkpoints and saved team are
the single-process ones.

Tolerance: every per-step metric (rewards, returns, advantages, losses, grad norms, KL, clip fraction,
learning rates, token counts), the trained parameters and the evaluation must agree to rel 1e-4 (abs 1e-6
near zero). Both runs sample the same tokens (per-call seeds) and run the same float operations, so with
the same torch thread count (1 here: what an actor with 0.5 CPU uses) the measured deviation is exactly 0.
A different thread count only changes float rounding: with 2 threads here, metrics still agree to ~1e-7,
but single weights whose gradient is ~0 can differ by ~1e-3 relative (Adam divides that gradient's
rounding noise by its own size), which is why the comparison pins the thread count.
"""

from __future__ import annotations

import shutil

import pytest
import ray  # in the `test` extra: CI runs these, never skips them
import torch

from teamrl.checkpoint import agent_state
from teamrl.config import config_from_dict
from teamrl.team import Team
from teamrl.train import Trainer

REL, ABS = 1e-4, 1e-6
STEPS = 3
# timings and this process's memory (the agents live elsewhere under Ray): the only metrics allowed to differ
MEASURED = ("time/", "tokens/per_second", "memory/")


@pytest.fixture(autouse=True)
def _actor_threads(_two_threads):
    torch.set_num_threads(1)  # the actors' count (max(1, floor(0.5 CPU))); _two_threads restores it afterwards


@pytest.fixture(scope="module")
def local_ray():
    # Fractional CPUs per agent: two actors holding a whole CPU each would leave a 2-core Ray nothing
    # to schedule with.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _config(tiny_config_data, run_dir, backend: str, steps: int = STEPS):
    return config_from_dict(tiny_config_data(
        steps=steps, run_dir=str(run_dir), distributed={"backend": backend, "cpus_per_agent": 0.5}))


def _assert_same_metrics(expected: list[dict], actual: list[dict]) -> None:
    assert len(expected) == len(actual)
    for want, got in zip(expected, actual):
        assert want.keys() == got.keys()
        for key, value in want.items():
            if not key.startswith(MEASURED):
                assert got[key] == pytest.approx(value, rel=REL, abs=ABS), (want["step"], key)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_run_matches_the_single_process_run(local_ray, tiny_config_data, tmp_path):
    local = Trainer(_config(tiny_config_data, tmp_path / "local", "local"))
    expected = [local.train_step() for _ in range(STEPS)]

    remote = Trainer(_config(tiny_config_data, tmp_path / "ray", "ray"))
    try:
        actual = [remote.train_step() for _ in range(STEPS)]
        _assert_same_metrics(expected, actual)
        # Training did something: every agent got a gradient, and its weights moved the same way in both runs.
        assert all(step[f"{name}/grad_norm"] > 0 for step in actual for name in ("first", "second"))
        untrained = Team.from_config(local.config.team, local.env, seed=local.config.seed)
        for agent, optimizer, scheduler, got, before in zip(
                local.team, local.agents.optimizers, local.agents.schedulers, remote.team.states(), untrained):
            initial = dict(before.model.named_parameters())
            assert any(not torch.equal(tensor, initial[name]) for name, tensor in got.parameters.items())
            for name, tensor in agent_state(agent, optimizer, scheduler).parameters.items():
                torch.testing.assert_close(got.parameters[name], tensor, rtol=REL, atol=ABS)
        assert remote.evaluate(num_samples=2) == pytest.approx(local.evaluate(num_samples=2), rel=REL, abs=ABS)
        # Scoring completions under the current policies, in the actors as here.
        generations = local._last_tree.turns[0].generations
        for here, there in zip(local.agents.logprobs(generations), remote.agents.logprobs(generations)):
            torch.testing.assert_close(there, here, rtol=REL, atol=ABS)
    finally:
        remote.team.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_madpo_under_ray_matches_the_single_process_run(local_ray, tiny_config_data, tmp_path):
    # MADPO reads every agent's reference log-probs through the backend and updates on the 'dpo' loss: under
    # Ray each actor keeps its reference copy and runs that loss, to the single-process numbers.
    def config(run_dir, backend):
        return config_from_dict(tiny_config_data(steps=2, run_dir=str(run_dir), algorithm={"name": "madpo"},
                                                 distributed={"backend": backend, "cpus_per_agent": 0.5}))

    local = Trainer(config(tmp_path / "local", "local"))
    expected = [local.train_step() for _ in range(2)]
    remote = Trainer(config(tmp_path / "ray", "ray"))
    try:
        actual = [remote.train_step() for _ in range(2)]
        _assert_same_metrics(expected, actual)
        assert all(step["preference/pairs"] > 0 and step["first/grad_norm"] > 0 for step in actual)
    finally:
        remote.team.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_checkpoints_resume_and_saved_team_are_the_local_format(local_ray, tiny_config_data, tmp_path):
    # A Ray run checkpoints step 2 and saves its team; a local run resumes from that checkpoint and a Ray
    # run from a copy of it: both take step 3 to the same numbers.
    first = Trainer(_config(tiny_config_data, tmp_path / "ray", "ray", steps=2))
    try:
        first.train()
        saved = Team.from_pretrained(first.save_team())
        for agent, state in zip(saved, first.team.states()):
            for name, p in agent.model.named_parameters():
                torch.testing.assert_close(p, state.parameters[name])
    finally:
        first.team.shutdown()
    shutil.copytree(tmp_path / "ray", tmp_path / "ray_resumed")

    local = Trainer(_config(tiny_config_data, tmp_path / "ray", "local"), resume=True)
    expected = local.train()
    resumed = Trainer(_config(tiny_config_data, tmp_path / "ray_resumed", "ray"), resume=True)
    try:
        actual = resumed.train()
    finally:
        resumed.team.shutdown()
    assert [m["step"] for m in actual] == [m["step"] for m in expected] == [3]
    _assert_same_metrics(expected, actual)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_actors_of_a_quiet_driver_keep_the_libraries_quiet(local_ray, tiny_config_data, tmp_path, monkeypatch):
    # An actor's process inherits neither the driver's warning filters nor, on a cluster, its environment:
    # it is told to be quiet when the driver is (teamrl without --verbose), and only then.
    from teamrl.backends import ray as ray_team
    from teamrl.envs.base import make_env

    def library_output_off(worker) -> bool:  # run in the actor
        import warnings

        from transformers.utils import logging as transformers_logging

        with warnings.catch_warnings(record=True) as shown:
            warnings.warn("probe", FutureWarning, stacklevel=1)
        return not shown and not transformers_logging.is_progress_bar_enabled()

    config = _config(tiny_config_data, tmp_path / "ray", "ray")
    env = make_env(config.env.name, **config.env.kwargs)
    for driver_quiet in (True, False):
        monkeypatch.setattr(ray_team, "libraries_quiet", lambda quiet=driver_quiet: quiet)
        team = ray_team.RayTeam(config, env)
        try:
            assert ray.get([actor.__ray_call__.remote(library_output_off) for actor in team._actors]) == \
                [driver_quiet] * len(team)
        finally:
            team.shutdown()
