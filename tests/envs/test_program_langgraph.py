"""A LangGraph graph trained unchanged: two nodes, each calling its agent with the official openai client, the graph
compiled once and invoked per episode with the episode's base URL in its run config."""

from __future__ import annotations

import json
import operator
from typing import Annotated, TypedDict

import pytest

pytest.importorskip("langgraph")
openai = pytest.importorskip("openai")

from langchain_core.runnables import RunnableConfig  # noqa: E402  (langgraph's own dependency)
from langgraph.graph import END, START, StateGraph  # noqa: E402

TARGET = "good"


class State(TypedDict):
    topic: str
    plan: str
    text: str
    calls: Annotated[list[str], operator.add]


def _ask(config: RunnableConfig, model: str, content: str) -> str:
    client = openai.OpenAI(base_url=config["configurable"]["base_url"], api_key="-", max_retries=0, timeout=60)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}]
                                          ).choices[0].message.content


def planner(state: State, config: RunnableConfig) -> dict:
    return {"plan": _ask(config, "planner", "plan " + state["topic"]), "calls": ["planner"]}


def writer(state: State, config: RunnableConfig) -> dict:
    return {"text": _ask(config, "writer", "write " + state["plan"]), "calls": ["writer"]}


builder = StateGraph(State)
builder.add_node("planner", planner)
builder.add_node("writer", writer)
builder.add_edge(START, "planner")
builder.add_edge("planner", "writer")
builder.add_edge("writer", END)
GRAPH = builder.compile()


def run(item: dict, base_url: str) -> float:
    """One episode: the graph as it is, pointed at the episode's endpoint."""
    final = GRAPH.invoke({"topic": item["topic"], "plan": "", "text": "", "calls": []},
                         config={"configurable": {"base_url": base_url}})
    assert final["calls"] == ["planner", "writer"]
    words = final["plan"].split() + final["text"].split()
    return words.count(TARGET) / max(len(words), 1)


@pytest.fixture
def config(tiny_config, tmp_path):
    topics = ["good bad", "bad plan", "write good", "plan bad good", "bad", "good good bad", "plan", "write bad"]
    (tmp_path / "topics.jsonl").write_text("".join(json.dumps({"topic": t}) + "\n" for t in topics * 3))

    def make(**overrides):
        return tiny_config(
            env={"name": "program", "kwargs": {"program": f"{__name__}:run", "data": str(tmp_path / "topics.jsonl"),
                                               "eval_split": 4, "words": ["good", "bad", "plan", "write"]}},
            team={"model": "tiny", "training": "lora", "sampling": {"max_new_tokens": 6},
                  "agents": [{"name": "planner"}, {"name": "writer"}]}, **overrides)

    return make


def test_a_two_node_langgraph_graph_trains_each_node_as_its_own_agent(config):
    from teamrl.train import Trainer

    with Trainer(config(steps=1, items_per_step=2, algorithm={"num_generations": 4}, optim={"lr": 0.05})) as trainer:
        before = [[p.detach().clone() for p in agent.parameters] for agent in trainer.team]
        metrics = trainer.train_step()
        assert metrics["planner/calls_per_episode"] == 1 and metrics["writer/calls_per_episode"] == 1
        assert metrics["planner/tokens"] > 0 and metrics["writer/tokens"] > 0
        moved = [any(not b.equal(p) for b, p in zip(old, agent.parameters)) for old, agent in zip(before, trainer.team)]
        # Either agent moves unless all 4 episodes of both items tied (then no advantage, no step): check the rewards.
        tied = metrics["advantage/abs_mean"] == 0
        assert moved == [not tied, not tied]


@pytest.mark.slow
def test_the_langgraph_pipeline_learns_its_reward(config, train_and_evaluate):
    before, after, history = train_and_evaluate(config(steps=30, items_per_step=2, algorithm={"num_generations": 8},
                                                       optim={"lr": 0.03}), stop_at=0.5)
    # Measured here: held-out 0.24 -> 0.59 (of 1.0) in 8 steps.
    assert after > before + 0.15, (before, after, [round(h["reward/mean"], 2) for h in history])
