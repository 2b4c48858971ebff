"""Tiny saved teams to serve, in-process apps (FastAPI's TestClient) and a real uvicorn server in a thread."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="teamrl serve needs the serve extra (pip install 'teamrl[serve]')")


def _saved_team(root: Path, name: str, env: dict, training: str) -> Path:
    """A tiny two-agent team trained for one step (as tests/conftest.py's tiny_config), saved as ROOT/NAME/team."""
    from teamrl.config import config_from_dict
    from teamrl.train import Trainer

    config = config_from_dict({
        "env": env,
        "team": {"model": "tiny", "training": training, "sampling": {"max_new_tokens": 4},
                 "agents": [{"name": "first"}, {"name": "second"}]},
        "algorithm": {"num_generations": 4}, "steps": 1, "items_per_step": 2, "seed": 0,
        "run_dir": str(root / name), "logging": {"progress_bar": False}, "checkpoint": {"save_every": 0},
        "eval": {"every_steps": 0},
    })
    with Trainer(config) as trainer:
        return trainer.save_team(root / name / "team")


@pytest.fixture(scope="session")
def digits_team_dir(tmp_path_factory) -> Path:
    """The README's smoke team (digit_sum, two fully fine-tuned tiny agents), saved as RUN_DIR/team of run 'digits'."""
    return _saved_team(tmp_path_factory.mktemp("teams"), "digits",
                       {"name": "digit_sum", "kwargs": {"targets": [9], "length": 4}}, "full")


@pytest.fixture(scope="session")
def tldr_team_dir(tmp_path_factory) -> Path:
    """A TL;DR team as `teamrl demo` saves one (two LoRA agents on one base) on the tiny model (256-token context)."""
    return _saved_team(tmp_path_factory.mktemp("teams"), "tldr", {"name": "tldr", "kwargs": {}}, "lora")


@pytest.fixture(scope="session")
def digits_served(digits_team_dir):
    from teamrl.serve.engine import ServedTeam

    return ServedTeam.load(digits_team_dir)


@pytest.fixture(scope="session")
def tldr_served(tldr_team_dir):
    from teamrl.serve.engine import ServedTeam

    return ServedTeam.load(tldr_team_dir)


@pytest.fixture
def serve_client():
    """Factory: ``serve_client(served, **create_app options)`` -> a started TestClient (stopped after the test)."""
    from fastapi.testclient import TestClient

    from teamrl.serve.app import create_app

    with contextlib.ExitStack() as stack:
        def make(served, **options):
            return stack.enter_context(TestClient(create_app(served, **options)))

        yield make


@pytest.fixture
def live_server():
    """Factory: ``live_server(served, **create_app options)`` -> (base URL, app) of a real uvicorn server on a free
    port of 127.0.0.1, in a thread; stopped, within 10 s, after the test."""
    import uvicorn

    from teamrl.serve.app import _listening_socket, create_app

    servers = []

    def start(served, **options):
        app = create_app(served, **options)
        listener = _listening_socket("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{listener.getsockname()[1]}", app

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive(), "the server did not stop"
