"""The training loop: wires config -> environment -> team -> training steps, with logging and checkpoints.

A step is a rollout tree (:func:`teamrl.rollout.tree.sample_tree`) and what the run's algorithm
(``algorithm.name``: MAGRPO, :mod:`teamrl.algorithms.magrpo`, by default; :mod:`teamrl.algorithms.base`)
learns from it; the agents live behind :mod:`teamrl.backends`. This module only decides which items a
step sees, writes metrics and samples, and saves/resumes checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from teamrl.algorithms.base import AgentBackend, Algorithm, make_algorithm, make_environment
from teamrl.algorithms.update import NonFiniteUpdate
from teamrl.backends import make_backend
from teamrl.backends.ranks import any_rank, barrier, is_main_process
from teamrl.checkpoint import (
    CheckpointUnreadable,
    NonFiniteWeights,
    discard_checkpoints_after,
    load_checkpoint,
    require_finite,
    save_checkpoint,
)
from teamrl.config import TrainConfig, config_to_dict
from teamrl.envs.base import Environment, Item, configured_env, env_record
from teamrl.envs.checks import EnvironmentOutputError
from teamrl.envs.program import ProgramTask
from teamrl.evaluation import heldout
from teamrl.evaluation.heldout import EVAL_ITEMS_PER_BATCH
from teamrl.evaluation.plots import plot_run
from teamrl.rollout.episodes import ProgramRollout, run_episodes
from teamrl.rollout.generate import derive_seed
from teamrl.rollout.tree import RolloutTree, sample_tree
from teamrl.run_dir import (
    CHECKPOINT_PREFIX,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    EVAL_FILE,
    METRICS_FILE,
    SAMPLES_FILE,
    TEAM_DIR,
    TENSORBOARD_DIR,
    RunDirError,
    ask_for,
    claim_run_dir,
    clear_run_outputs,
    complete_checkpoints,
    how_to_resume,
    read_records,
    run_config,
)
from teamrl.runtime import release_freed_memory, seed_everything
from teamrl.team import Team
from teamrl.user_code import UserCodeError

if TYPE_CHECKING:
    from teamrl.backends.ray import RayTeam
    from teamrl.serve.gateway import Gateway

log = logging.getLogger(__name__)

GIB = 2**30
"""Bytes in a GiB: memory metrics are in GiB, as torch and nvidia-smi count."""


def batch_indices(num_items: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Item indices of ``step`` (0-based): consecutive slices of per-epoch shuffles, a pure function of its args.

    Being a function of the step alone is what lets a resumed run see exactly the items the
    uninterrupted run would have.
    """
    indices = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_items)
        order = list(range(num_items))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        indices.append(order[offset])
    return indices


class TrainingInterrupted(KeyboardInterrupt):
    """:meth:`Trainer.train` stopped on SIGINT (Ctrl-C) or SIGTERM. The message says which checkpoint holds
    the run and how to resume it. A KeyboardInterrupt, like the one Ctrl-C raises: ``except Exception``
    does not swallow it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
        """The exit status of a process killed by that signal, as shells report it."""


class TrainingStopped(ValueError):
    """Training stopped before learning from what it cannot use: the task's code raised an exception
    (:class:`~teamrl.user_code.UserCodeError`) or returned a wrong or non-finite value
    (:class:`~teamrl.envs.checks.EnvironmentOutputError`), an update's gradients were not
    finite, or a checkpoint's weights were. The message says at which step, why, and which checkpoint is
    kept (every one on disk is finite) with the command that resumes from it."""


class Trainer:
    """Trains a team with the algorithm ``config`` names (MAGRPO by default), as ``config`` says.

    ``team`` and ``env`` may be given directly (Python API); otherwise they are built from the config.
    The Trainer reaches the agents only through :attr:`agents`, an :class:`~teamrl.algorithms.base.AgentBackend`:
    in this process (sampled by transformers or vLLM), or in Ray actors (``distributed.backend='ray'``),
    which this process drives: it samples every turn through all of them at once, computes rewards and
    advantages itself, and has them all update at once.

    A Trainer holds ``config.run_dir`` from construction until :meth:`close` (or the end of a ``with``
    block, or of the process): a second training into it is refused (:mod:`teamrl.run_dir`). ``resume``
    continues the run there from its newest readable checkpoint; ``overwrite`` replaces the run there;
    without either, a directory that already holds a run is refused. These checks run before any model
    loads.
    """

    def __init__(self, config: TrainConfig, *, team: Team | None = None, env: Environment | None = None,
                 resume: bool = False, overwrite: bool = False):
        self.config = config
        self.run_dir = Path(config.run_dir)
        # In a multi-process job (distributed.backend: fsdp) every rank trains and rank 0 alone writes the run.
        self._writes = is_main_process()
        self._run_lock = (claim_run_dir(self.run_dir, resume=resume, overwrite=overwrite) if self._writes
                          else _WrittenByRankZero())
        try:
            self._build(team, env)
            if resume:
                self._resume()
            elif overwrite and self._writes:  # only now that the new run is built: a failed load keeps the old one
                clear_run_outputs(self.run_dir)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the gateway of a program task and let go of the run directory (another training may use it then)."""
        if getattr(self, "gateway", None) is not None:
            self.gateway.stop()
            self.gateway = None
        self._run_lock.release()

    def _build(self, team: Team | None, env: Environment | None) -> None:
        """The environment, the team (or its Ray actors), the data and the optimisers."""
        config = self.config
        if config.logging.tensorboard:
            _require("tensorboard", "logging.tensorboard")
        if config.logging.wandb_project:
            _require("wandb", "logging.wandb_project")
        seed_everything(config.seed)
        # The algorithm's view of the task (centralized: one agent doing every seat's part).
        self.task = env if env is not None else configured_env(config.env.name, config.env.kwargs, config.env.folders)
        """The task as given or configured (:attr:`env` is the algorithm's view of it)."""
        if isinstance(self.task, ProgramTask):
            seat_program_agents(self.task, [agent.name for agent in config.team.agents])
        self.env = make_environment(config, self.task)
        self._task_record = task_record(self.task)
        self.env.check_num_turns(config.algorithm.num_turns)  # at most max_turns; a sparse task's paying turn
        self.agents: AgentBackend = make_backend(config, self.env, team)
        """Where the agents live and how they are sampled and updated (:mod:`teamrl.backends`)."""
        self.gateway: Gateway | None = None
        """A program task's episodes call the team here (:mod:`teamrl.serve.gateway`); None for other tasks."""
        if isinstance(self.env, ProgramTask):
            from teamrl.serve.gateway import Gateway

            self.gateway = Gateway(self.agents.team, self.env, engine=self.agents.token_engine())
            self.gateway.start()
        self.agent_names = self.agents.names
        self.algorithm: Algorithm = make_algorithm(config, self.env, self.agents)
        """What a step learns from its rollout (``algorithm.name``, :mod:`teamrl.algorithms.base`)."""
        self.items: Sequence[Item] = self.env.items("train")
        if not self.items:
            raise ValueError(f"env: {type(self.env).__name__} has no training items")
        self.step = 0
        self.evaluations: list[dict[str, float]] = []
        """The run's held-out evaluations so far, as in its ``eval.jsonl`` (a resumed run's earlier ones too)."""
        self._writers: list[Any] = []

    # ----------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One step on the next batch of items (the rollout, then the algorithm's learning); returns its metrics.

        Raises:
            TrainingStopped: the task's code raised, or returned a value that cannot be learnt from, or an
                update's gradients were not finite; the optimiser step that would have used it was not taken.
        """
        try:
            return self._rollout_and_learn()
        except (UserCodeError, EnvironmentOutputError, NonFiniteUpdate) as err:
            raise self._stopped(self.step + 1, err) from err

    def _rollout_and_learn(self) -> dict[str, float]:
        config = self.config
        start = time.perf_counter()
        items = [self.items[i] for i in batch_indices(len(self.items), config.items_per_step, self.step, config.seed)]
        names = self.agent_names
        seeds = [derive_seed(config.seed, self.step, "update", i) for i in range(len(names))]
        # Every draw of the step is seeded from (seed, step): a resumed run, or one whose agents live in
        # Ray actors, samples and updates exactly as this uninterrupted, single-process one.
        if self.gateway is not None:  # a program task: its episodes, all at once, through the gateway
            rollout = self._program_episodes(items, config.algorithm.num_generations,
                                             derive_seed(config.seed, self.step))
            generation_seconds, generated = rollout.seconds, rollout.num_tokens
            update_start = time.perf_counter()
            metrics = self.algorithm.learn_episodes(rollout, self.agents, seeds)
            self._last_samples = program_samples(rollout, names)
        else:
            tree = sample_tree(self.agents.sample, self.env, items, config.algorithm,
                               seed=derive_seed(config.seed, self.step))
            generation_seconds = sum(t.generation_seconds for t in tree.turns)
            update_start = time.perf_counter()
            metrics = self.algorithm.learn(tree, self.agents, seeds)
            generated = sum(gen.num_tokens for t in tree.turns for gen in t.generations)
            self._last_tree = tree
            self._last_samples = _samples(tree)
        self.step += 1
        release_freed_memory()  # what the update freed, before the next step's rollout
        metrics.update({
            "step": self.step,
            "loss": sum(metrics[f"{name}/loss"] for name in names),
            "kl": sum(metrics[f"{name}/kl"] for name in names) / len(names),
            "clip_fraction": sum(metrics[f"{name}/clip_fraction"] for name in names) / len(names),
            "grad_norm": max(metrics[f"{name}/grad_norm"] for name in names),
            "tokens/generated": float(generated),
            "tokens/per_second": generated / max(generation_seconds, 1e-9),
            "time/generation": generation_seconds,
            "time/update": time.perf_counter() - update_start,
            "time/step": time.perf_counter() - start,
            **memory_metrics(),
        })
        return metrics

    def _program_episodes(self, items: Sequence[Item], num_episodes: int, seed: int) -> ProgramRollout:
        """``num_episodes`` episodes of the program task on each of ``items``, through the gateway."""
        return run_episodes(self.env, self.gateway, items, num_episodes, seed=seed,
                            pad_token_ids=[agent.tokenizer.pad_token_id or 0 for agent in self.team])

    def train(self, after_step: Callable[[dict[str, float]], bool] | None = None,
              after_evaluation: Callable[[dict[str, float], list[dict[str, Any]]], None] | None = None,
              ) -> list[dict[str, float]]:
        """Run until ``config.steps`` updates are done (from the checkpoint, when built with ``resume``).

        ``after_step(metrics)``, when given, runs after each step is logged (``teamrl compare`` evaluates
        there); returning True ends training after that step, which is checkpointed.

        The team is scored on held-out items as ``config.eval`` says: at step 0, every ``eval.every_steps``
        steps and at the last step (or the one ``after_step`` ends), each step once in a run, however often it
        resumes. Each evaluation is a line of ``eval.jsonl``, logged under ``eval/...`` and shown on the
        progress bar; ``after_evaluation(record, samples)``, when given, gets its line and its joint actions
        (:meth:`evaluate_with_samples`). Training draws the same samples with or without evaluations. When
        training ends, ``reward_curve.png`` plots the run's training reward and held-out evaluations
        (:func:`~teamrl.evaluation.plots.plot_run`).

        SIGINT (Ctrl-C) or SIGTERM stops the run at the end of the step under way: that step is
        checkpointed and :class:`TrainingInterrupted` says how to resume. A second one stops at once,
        keeping the last checkpoint.
        """
        config = self.config
        if self._writes:
            run_settings = run_config(config_to_dict(config), self.run_dir, self._task_record)
            (self.run_dir / CONFIG_FILE).write_text(yaml.safe_dump(run_settings, sort_keys=False))
            self._open_writers()
        history = []
        progress = _progress(config, initial=self.step) if self._writes else None
        evaluate_every = self._evaluation_interval()
        try:
            with _StopAtStepEnd() as stop:
                if self._evaluation_due(evaluate_every, finished=False):
                    self._evaluate_held_out(after_evaluation)
                    if progress is not None:
                        progress.set_postfix(self._progress_postfix())
                while self.step < config.steps:
                    metrics = self.train_step()
                    history.append(metrics)
                    self._log(metrics)
                    finished = after_step is not None and after_step(metrics)
                    if self._evaluation_due(evaluate_every, finished):
                        self._evaluate_held_out(after_evaluation)
                    if progress is not None:
                        progress.update(1)
                        progress.set_postfix(self._progress_postfix(metrics))
                    every = config.checkpoint.save_every
                    # A signal during the last step changes nothing: the run is complete.
                    # Every rank stops after the same step (its checkpoint is a collective), whichever saw the signal.
                    stopping = any_rank(stop.signum is not None) and self.step < config.steps and not finished
                    if self.step == config.steps or (every and self.step % every == 0) or stopping or finished:
                        checkpoint = self.save()
                    if stopping:
                        raise TrainingInterrupted(
                            f"{signal.Signals(stop.signum).name}: stopped after step {self.step} of {config.steps}, "
                            f"saved in {checkpoint}; resume with: {how_to_resume(self.run_dir)}", stop.signum)
                    if finished:
                        break
            if self._writes:
                plot_run(self.run_dir)
        except _StopNow as stop_now:
            kept = complete_checkpoints(self.run_dir)
            what = (f"the last checkpoint, {kept[0]}, is kept; resume with: {how_to_resume(self.run_dir)}" if kept
                    else f"no checkpoint was written: start again {ask_for('overwrite')}")
            raise TrainingInterrupted(f"{signal.Signals(stop_now.signum).name} twice: stopped at once; {what}",
                                      stop_now.signum) from None
        finally:
            if progress is not None:
                progress.close()
            for writer in self._writers:
                writer.close()
        return history

    @property
    def team(self) -> Team | RayTeam:
        """The team: its agents in this process, or the :class:`~teamrl.backends.ray.RayTeam` of its actors."""
        return self.agents.team

    def save_team(self, directory: str | Path | None = None) -> Path:
        """Save the trained team (default ``run_dir/team``) with how to build the task it was trained on
        (the environment object given to the Trainer, else the config's; :func:`~teamrl.envs.base.env_record`),
        so that ``teamrl generate`` and ``teamrl eval`` run it on the same task.

        Raises:
            NonFiniteWeights: a weight is NaN or inf (nothing is written).
        """
        directory = directory or self.run_dir / TEAM_DIR
        require_finite(dict(zip(self.agent_names, self.agents.states())), f"team {directory}")
        return self.agents.save(directory,
                                metadata={"env": self._task_record, "algorithm": self.config.algorithm.name,
                                          "seed": self.config.seed, "step": self.step})

    def save(self) -> Path:
        """Checkpoint the current step.

        Raises:
            TrainingStopped: a weight is NaN or inf; nothing is written and the checkpoints on disk are kept.
        """
        states = {**dict(zip(self.agent_names, self.agents.states())), **self.algorithm.states()}
        try:
            if not self._writes:  # every rank holds the same full states: each refuses non-finite ones alike
                require_finite(states, f"checkpoint of step {self.step}")
                barrier()
                return self.run_dir / CHECKPOINTS_DIR / f"{CHECKPOINT_PREFIX}{self.step:06d}"
            written = save_checkpoint(self.run_dir, self.step, states, keep_last=self.config.checkpoint.keep_last)
            barrier()
            return written
        except NonFiniteWeights as err:
            raise self._stopped(self.step, err) from err

    def _stopped(self, step: int, err: Exception, when: str = "") -> TrainingStopped:
        """Why training stops at ``step`` (``err``, ``when`` in the step), and what it keeps on disk: the newest
        checkpoint, with the command that resumes from it, or none."""
        kept = complete_checkpoints(self.run_dir)
        what = (f"the last checkpoint, {kept[0]}, is kept; fix the cause, then resume with: "
                f"{how_to_resume(self.run_dir)}" if kept
                else f"no checkpoint was written yet: fix the cause, then start again {ask_for('overwrite')}")
        when = when or ("before its update" if isinstance(err, (UserCodeError, EnvironmentOutputError)) else "")
        return TrainingStopped(f"training stopped at step {step} of {self.config.steps}{', ' + when if when else ''}: "
                               f"{err}; {what}")

    def evaluate(self, split: str = "eval", num_samples: int = 1, max_items: int | None = None,
                 seed: int | None = None, items_per_batch: int = EVAL_ITEMS_PER_BATCH) -> dict[str, float]:
        """Mean joint return (and mean reward parts) of the team on ``split``: episodes of ``algorithm.num_turns``
        turns, each agent answering the environment's feedback after the first, every turn's joint reward summed.

        Sampling is seeded (``seed``, default the run's seed), so evaluating twice gives the same numbers
        for the same weights, and training's samples are the same whether or not it evaluates. Items are
        sampled ``items_per_batch`` at a time (a generate call's cost grows faster than its batch).
        """
        return self.evaluate_with_samples(split, num_samples, max_items, seed, items_per_batch)[0]

    def evaluate_with_samples(self, split: str = "eval", num_samples: int = 1, max_items: int | None = None,
                              seed: int | None = None, items_per_batch: int = EVAL_ITEMS_PER_BATCH,
                              ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """:meth:`evaluate`, plus every joint action with what each agent saw and its reward.

        Held-out evaluation's one path (:mod:`teamrl.evaluation.heldout`), which ``teamrl eval``'s ``team:PATH``
        takes too: the saved team scores the same numbers there, under ``teamrl eval``'s names (here under
        training's, :func:`~teamrl.evaluation.heldout.training_view`).
        """
        items = list(self.env.items(split))[:max_items]
        if not items:
            raise ValueError(f"{type(self.env).__name__} has no {split!r} items to evaluate on")
        if self.gateway is not None:  # a program task: its episodes on the held-out items
            episodes = heldout.program_held_out(self.env, self.gateway, items, num_samples,
                                                self.config.seed if seed is None else seed, items_per_batch)
            return heldout.program_view(episodes, self.agent_names)
        output = heldout.sample_held_out(self.agents.sample, self.env, items, num_samples,
                                         self.config.seed if seed is None else seed, items_per_batch,
                                         num_turns=self.config.algorithm.num_turns)
        return heldout.training_view(*heldout.score(self.env, output, num_samples))

    @property
    def held_out_items(self) -> Sequence[Item]:
        """The items a scheduled held-out evaluation scores: the first ``eval.items`` of the environment's
        'eval' split (none when it has no such split)."""
        return list(self.env.items("eval"))[:self.config.eval.items] if "eval" in self.env.splits else []

    # ----------------------------------------------------------------------------------------------
    def _evaluation_interval(self) -> int:
        """Steps between this run's held-out evaluations (``config.eval``); 0 when off, or when the environment
        has no held-out items (said once, in a warning: a task without them still trains)."""
        every = self.config.eval.interval(self.config.steps)
        if every and not self.held_out_items:
            log.warning("eval: %s has no 'eval' items: training without held-out evaluation (eval.every_steps=0 "
                        "turns it off)", type(self.env).__name__)
            return 0
        return every

    def _evaluation_due(self, every: int, finished: bool) -> bool:
        """Whether the current step is evaluated: step 0, every ``every`` steps and the run's last step
        (``finished``: the one ``after_step`` ended), unless ``eval.jsonl`` has it (a resumed run)."""
        if not every or any(evaluation["step"] == self.step for evaluation in self.evaluations):
            return False
        return self.step % every == 0 or self.step == self.config.steps or finished

    def _progress_postfix(self, metrics: dict[str, float] | None = None) -> dict[str, str]:
        """What the progress bar shows: the last step's training reward and loss, the latest held-out reward."""
        postfix = {"reward": f"{metrics['reward/mean']:.3f}", "loss": f"{metrics['loss']:.3g}"} if metrics else {}
        if self.evaluations:
            postfix["held_out"] = f"{self.evaluations[-1]['reward/mean']:.3f}"
        return postfix

    def _evaluate_held_out(self, after_evaluation: Callable[[dict[str, float], list[dict[str, Any]]], None] | None,
                           ) -> None:
        """Score the team on the held-out items as ``config.eval`` says, append the result to ``eval.jsonl`` and
        log it under ``eval/...``. Its own seed keeps training's samples as they would be without it."""
        settings = self.config.eval
        began = time.perf_counter()
        try:
            metrics, samples = self.evaluate_with_samples(num_samples=settings.samples, max_items=settings.items,
                                                          seed=settings.seed)
        except (UserCodeError, EnvironmentOutputError) as err:
            raise self._stopped(self.step, err, "in its held-out evaluation") from err
        seconds = time.perf_counter() - began
        record = {"step": self.step, **metrics, "items": len(samples) // settings.samples,
                  "samples": settings.samples, "seconds": seconds}
        self.evaluations.append(record)
        if self._writes:
            with open(self.run_dir / EVAL_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")
        for writer in self._writers:
            writer.log({**{f"eval/{name}": value for name, value in metrics.items()}, "eval/seconds": seconds},
                       self.step)
        if after_evaluation is not None:
            after_evaluation(record, samples)

    def _resume(self) -> None:
        """Load the newest checkpoint that reads back whole (a damaged one is skipped with a warning: that
        is what ``checkpoint.keep_last`` > 1 keeps older ones for) and drop what the run logged after it."""
        for partial in (self.run_dir / CHECKPOINTS_DIR).glob(".tmp-*") if self._writes else ():
            shutil.rmtree(partial, ignore_errors=True)  # left by a run killed mid-save
        for checkpoint in complete_checkpoints(self.run_dir):
            try:
                states, state = load_checkpoint(checkpoint, [*self.agent_names, *self.algorithm.states()])
                break
            except CheckpointUnreadable as err:
                log.warning("%s; trying the checkpoint before it", err)
        else:
            raise RunDirError(f"run_dir: no checkpoint in {str(self.run_dir)!r} can be read (see the warnings "
                              f"above); start a new run {ask_for('overwrite')}")
        self.agents.load_states([states.pop(name) for name in self.agent_names], checkpoint)
        self.algorithm.load_states(states, checkpoint)
        self.step = int(state["step"])
        # Steps logged or checkpointed after this checkpoint will be redone: drop them.
        if self._writes:
            for skipped in discard_checkpoints_after(self.run_dir, self.step):
                log.warning("removed %s: the run resumes from %s and redoes its steps", skipped, checkpoint)
            for name in (METRICS_FILE, SAMPLES_FILE, EVAL_FILE):
                _truncate_jsonl(self.run_dir / name, self.step)
        barrier()  # every rank reads eval.jsonl as rank 0 left it: they evaluate at the same steps
        if (self.run_dir / EVAL_FILE).exists():
            self.evaluations = read_records(self.run_dir / EVAL_FILE)

    def _open_writers(self) -> None:
        self._writers = []
        if self.config.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writers.append(_TensorBoard(SummaryWriter(str(self.run_dir / TENSORBOARD_DIR))))
        if self.config.logging.wandb_project:
            import wandb

            run = wandb.init(project=self.config.logging.wandb_project, dir=str(self.run_dir),
                             config=config_to_dict(self.config), resume="allow")
            self._writers.append(_WandB(run))

    def _log(self, metrics: dict[str, float]) -> None:
        if not self._writes:
            return
        with open(self.run_dir / METRICS_FILE, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        for writer in self._writers:
            writer.log(metrics, self.step)
        every = self.config.logging.sample_every
        if every and (self.step % every == 0 or self.step == 1):
            with open(self.run_dir / SAMPLES_FILE, "a") as f:
                f.write(json.dumps({"step": self.step, "samples": self._last_samples}) + "\n")


class _WrittenByRankZero:
    """The run directory's hold in a process that is not rank 0 of its job: rank 0 holds it (and writes it)."""

    def release(self) -> None:
        pass


def task_record(task: Environment) -> dict[str, Any]:
    """:func:`~teamrl.envs.base.env_record` of ``task``; where the task cannot be written down (a class in
    ``__main__``), a record saying why, which :func:`~teamrl.envs.base.rebuild_env` reports, and a warning
    now, before training rather than after it."""
    try:
        return env_record(task)
    except ValueError as err:
        log.warning("the saved team will not be able to rebuild its task for teamrl generate/eval: %s", err)
        return {"name": type(task).__qualname__, "unavailable": str(err)}


def seat_program_agents(task: ProgramTask, names: list[str]) -> None:
    """Give a program task the team's agents (its models), or check those it names against them."""
    if not task.agents:
        task.seat(names)
    elif task.agents != names:
        raise ValueError(f"env.kwargs.agents: {task.agents} are not the team's agents {names} (team.agents); leave "
                         f"env.kwargs.agents out, or name the same agents in the same order")


def program_samples(rollout: ProgramRollout, names: Sequence[str], per_item: int = 2) -> list[dict[str, Any]]:
    """A few episodes of the first item with each call's agent and answer and the reward, for samples.jsonl."""
    out = []
    for episode in rollout.episodes[0][:per_item]:
        out.append({"item": episode.item.get("id"),
                    "calls": [{"agent": names[call.agent], "text": call.completion.text} for call in episode.calls],
                    "reward": episode.result.total, "reward_parts": episode.result.parts,
                    "reward_counts": episode.result.counts})
    return out


def _samples(tree: RolloutTree, per_turn: int = 2) -> list[dict[str, Any]]:
    """A few joint actions per turn with what each agent saw and the reward, for samples.jsonl."""
    out = []
    for t, turn in enumerate(tree.turns, start=1):
        for m in range(min(per_turn, len(turn.combos))):
            out.append({
                "turn": t,
                "item": turn.items[0].get("id"),
                "observations": list(turn.observations[0]),
                "actions": list(turn.joint_action(0, m)),
                "reward": turn.results[m].total,
                "reward_parts": turn.results[m].parts,
                "reward_counts": turn.results[m].counts,
            })
    return out


class _StopNow(KeyboardInterrupt):
    """A second SIGINT or SIGTERM while the run was finishing its step for the first one."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum = signum


class _StopAtStepEnd:
    """While active, the first SIGINT or SIGTERM only records itself (``signum``), for the training loop to
    stop at the end of its step; a second one raises :class:`_StopNow` at once. Signal handlers can only
    be set in the main thread: elsewhere signals keep their usual effect."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopAtStepEnd:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            raise _StopNow(signum)
        self.signum = signum
        # os.write, not print: a handler may run while the main thread is inside a print to stderr.
        os.write(sys.stderr.fileno(), f"\nteamrl: {signal.Signals(signum).name}: finishing the step under way to "
                                      f"save a checkpoint (send it again to stop at once)\n".encode())


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the lines of steps up to ``last_step``, as written; a torn last line (a kill while appending) goes."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (json.JSONDecodeError, TypeError, KeyError):
            continue
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def memory_metrics() -> dict[str, float]:
    """This process's memory now, in GiB (2**30 bytes): resident (``memory/rss_gib``, Linux), its peak so far
    (``memory/peak_rss_gib``) and, on a GPU, the peaks of what torch allocated to tensors
    (``memory/cuda_peak_allocated_gib``) and of what its caching allocator reserved from the device
    (``memory/cuda_peak_reserved_gib``, what the GPU actually lost to this process; the gap is fragmentation and
    cached blocks). Logged every step, so a run shows whether its memory stays flat. Where the OS does not say
    (no /proc, or no ``resource`` module on Windows), that metric is left out."""
    metrics = {}
    try:
        with open("/proc/self/statm") as f:
            metrics["memory/rss_gib"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB
    except OSError:  # not Linux
        pass
    try:
        import resource
    except ImportError:  # Windows
        pass
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux, bytes on macOS
        metrics["memory/peak_rss_gib"] = peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        metrics["memory/cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        metrics["memory/cuda_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    return metrics


def _progress(config: TrainConfig, initial: int):
    if not config.logging.progress_bar:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=config.steps, initial=initial, desc=config.algorithm.name.upper(), unit="step",
                dynamic_ncols=True)


def _require(package: str, field: str) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ValueError(f"{field}: needs the {package!r} package; pip install 'teamrl[{package}]' or turn it off")


class _TensorBoard:
    def __init__(self, writer):
        self.writer = writer

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run):
        self.run = run

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()
