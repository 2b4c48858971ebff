"""The gateway: ``teamrl serve``'s app inside a training process, answering a program task's episodes.

While a program task trains (:class:`~teamrl.envs.program.ProgramTask`), its episodes call the team through this
endpoint on 127.0.0.1: the same FastAPI app as ``teamrl serve`` (:func:`~teamrl.serve.app.create_app`), its agents
under their bare names, each episode at a base URL of its own (``/episodes/KEY/v1``: ``OPENAI_BASE_URL`` is
process-wide, and the episodes run at once). Calls from every episode in flight decode together by continuous
batching (:class:`~teamrl.rollout.continuous.ContinuousBatcher`, or vLLM's engines with ``rollout.backend: vllm``:
:class:`~teamrl.rollout.vllm_continuous.VLLMTokenEngine`), each agent with its current policy and its own
sampling settings, and every call's exact prompt ids, completion ids and sampling log-probs land in its episode
(:class:`~teamrl.rollout.episodes.ProgramEpisode`): the update trains on those tokens, never re-tokenised text.
:func:`~teamrl.rollout.episodes.run_episodes` drives it through :meth:`open`, :meth:`close` and :meth:`wait_idle`.
"""

from __future__ import annotations

import threading
import time

import uvicorn

from teamrl.envs.base import Environment
from teamrl.rollout.continuous import TokenEngine
from teamrl.rollout.episodes import ProgramEpisode
from teamrl.serve.app import _GracefulServer, _listening_socket, create_app
from teamrl.serve.engine import ServedTeam
from teamrl.team import Team

#: Seconds the gateway's server may take to start listening, or to stop.
START_STOP_SECONDS = 30.0


class Gateway:
    """``team`` on an OpenAI-compatible endpoint of this process, for ``task``'s episodes (a context manager:
    started on entry, stopped on exit). ``max_rows``: the most calls decoding at once per base model. ``engine``:
    what samples the calls (default: the :class:`~teamrl.rollout.continuous.ContinuousBatcher`; a training run
    passes its backend's :meth:`~teamrl.backends.local.LocalBackend.token_engine`, vLLM's with
    ``rollout.backend: vllm``)."""

    def __init__(self, team: Team, task: Environment, *, max_rows: int = 64, engine: TokenEngine | None = None):
        self.episodes: dict[str, ProgramEpisode] = {}
        self.served = ServedTeam(team, task, "team")
        self.app = create_app(self.served, batching="continuous", max_batch=max_rows, episodes=self.episodes,
                              sample_as_trained=True, engine=engine)
        self.url = ""
        self._server: _GracefulServer | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Gateway:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Listen on a free port of 127.0.0.1 (:attr:`url`), serving from a thread of this process."""
        listener = _listening_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on")
        self._server = _GracefulServer(config, on_signal=lambda: None)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [listener]},
                                        name="teamrl-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_STOP_SECONDS
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("teamrl's gateway did not start listening on 127.0.0.1")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(START_STOP_SECONDS)
            self._server = self._thread = None

    def open(self, episode: ProgramEpisode) -> str:
        self.episodes[episode.key] = episode
        return f"{self.url}/episodes/{episode.key}/v1"

    def close(self, episode: ProgramEpisode) -> None:
        self.episodes.pop(episode.key, None)

    def wait_idle(self) -> None:
        self.app.state.batcher.engine.wait_idle()
