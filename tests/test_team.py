"""Teams: LoRA adapters on one shared base, full fine-tuning, heterogeneous bases, saving."""

from __future__ import annotations

import json

import torch

from teamrl.config import config_from_dict
from teamrl.envs import DigitSumGame
from teamrl.team import Team
from teamrl.train import Trainer


def _team(training: str, agents=None, kl=False):
    config = config_from_dict({"team": {"training": training, "agents": agents or [{"name": "a"}, {"name": "b"}],
                                        "sampling": {"max_new_tokens": 4}}})
    return Team.from_config(config.team, DigitSumGame(), seed=0, need_reference=kl)


def _logits(agent, text="target 9 first"):
    ids = agent.tokenizer(text, return_tensors="pt").input_ids
    agent.activate()
    with torch.no_grad():
        return agent.model(input_ids=ids).logits


def test_lora_agents_share_one_base_and_train_disjoint_adapters():
    team = _team("lora")
    a, b = team
    assert a.model is b.model  # one frozen base in memory, two adapters
    ids_a = {id(p) for p in a.parameters}
    ids_b = {id(p) for p in b.parameters}
    assert ids_a and ids_b and not ids_a & ids_b
    total = sum(p.numel() for p in a.model.parameters())
    assert sum(p.numel() for p in a.parameters) < 0.5 * total
    trainable_base = [n for n, p in a.model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert trainable_base == []


def test_updating_one_adapter_leaves_the_other_agent_and_the_reference_unchanged():
    team = _team("lora")
    a, b = team
    before_b = _logits(b)
    with a.reference() as reference:
        base_before = reference(input_ids=a.tokenizer("target 9 first", return_tensors="pt").input_ids).logits
    with torch.no_grad():
        for p in a.parameters:
            p.add_(0.5)
    after_a = _logits(a)
    assert torch.equal(_logits(b), before_b)
    assert not torch.allclose(after_a, before_b)
    with a.reference() as reference:
        base_after = reference(input_ids=a.tokenizer("target 9 first", return_tensors="pt").input_ids).logits
    assert torch.equal(base_before, base_after)  # the reference is the base with the adapter disabled


def test_full_training_gives_each_agent_its_own_model_and_a_frozen_reference():
    team = _team("full", kl=True)
    a, b = team
    assert a.model is not b.model
    assert a.reference_model is not None and not any(p.requires_grad for p in a.reference_model.parameters())
    assert {id(p) for p in a.parameters} == {id(p) for p in a.model.parameters()}


def test_heterogeneous_team_with_its_own_base_per_agent(tmp_path):
    from teamrl.models.tiny import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(DigitSumGame().vocabulary() + ["extra"], seed=3, hidden_size=32)
    model.save_pretrained(tmp_path / "other")
    tokenizer.save_pretrained(tmp_path / "other")
    team = _team("lora", agents=[{"name": "a"}, {"name": "b", "model": str(tmp_path / "other")}])
    a, b = team
    assert a.model is not b.model
    assert len(b.tokenizer) == len(a.tokenizer) + 1
    assert b.model.config.hidden_size == 32


def test_kl_penalty_trains_with_lora_reference(tiny_config):
    config = tiny_config(team={"training": "lora"}, steps=2, algorithm={"kl_coef": 0.1, "num_iterations": 2})
    trainer = Trainer(config)
    metrics = [trainer.train_step() for _ in range(2)]
    assert all(m["first/kl"] >= 0 for m in metrics)
    assert metrics[-1]["first/kl"] > 0  # after an update the adapter has moved away from the base


def test_save_pretrained_writes_peft_adapters_that_load_without_teamrl(tmp_path):
    from peft import PeftModel

    team = _team("lora")
    a, _ = team
    with torch.no_grad():
        for p in a.parameters:
            p.add_(0.1)
    expected = _logits(a)
    root = team.save_pretrained(tmp_path / "team")
    manifest = json.loads((root / "team.json").read_text())
    assert [agent["name"] for agent in manifest["agents"]] == ["a", "b"]
    from teamrl.models.tiny import tiny_model_and_tokenizer

    base, _ = tiny_model_and_tokenizer(DigitSumGame().vocabulary(), seed=0)
    loaded = PeftModel.from_pretrained(base, str(root / "a"))
    ids = a.tokenizer("target 9 first", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, expected, atol=1e-5)


def test_team_onednn_linear_switches_each_base_once_on_cpu_only(monkeypatch):
    import teamrl.team as team_module

    switched = []
    monkeypatch.setattr(team_module, "use_onednn_linears", lambda model: switched.append(model))
    for training, onednn_linear, calls in (("lora", True, 1), ("full", True, 2), ("lora", False, 0)):
        switched.clear()
        config = config_from_dict({"team": {"training": training, "onednn_linear": onednn_linear,
                                            "sampling": {"max_new_tokens": 4}}})
        team = Team.from_config(config.team, DigitSumGame(), seed=0)
        assert len(switched) == calls  # one shared base under LoRA, a model per agent under full training
        assert all(any(m is agent.model.get_base_model() if training == "lora" else m is agent.model
                       for agent in team) for m in switched)
    switched.clear()
    team_module.load_base_model("tiny", DigitSumGame(), seed=0, dtype=torch.float32, device="meta")
    assert switched == []
