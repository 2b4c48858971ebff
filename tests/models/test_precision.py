"""Mixed precision: a team fully fine-tuned with team.dtype bfloat16 keeps float32 master weights and computes in
bfloat16, so its updates move the weights as a float32 run's do (AdamW on bfloat16 weights rounds most away)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from teamrl.models.precision import compute_dtype
from teamrl.train import Trainer

STEPS = 2


def _train_and_save(tiny_config, tmp_path, dtype: str) -> tuple[list[dict], list[dict], Trainer]:
    """Each agent's weights before and after STEPS steps at the paper's lr order (saved team, read back)."""
    config = tiny_config(steps=STEPS, team={"dtype": dtype}, optim={"lr": 1e-5}, run_dir=str(tmp_path / dtype),
                         items_per_step=2, algorithm={"num_generations": 4})
    with Trainer(config) as trainer:
        before = [{name: p.detach().float().clone() for name, p in agent.model.named_parameters()}
                  for agent in trainer.team]
        for _ in range(STEPS):
            trainer.train_step()
        saved = trainer.save_team()
    after = [load_file(str(saved / name / "model.safetensors")) for name in trainer.agent_names]
    return before, after, trainer


def _moves(before: list[dict], after: list[dict]) -> torch.Tensor:
    return torch.cat([(after[i][name].float() - before[i][name]).flatten() for i in range(len(before))
                      for name in before[i] if name in after[i]])


def test_full_fine_tuning_in_bfloat16_moves_the_weights_as_float32_does(tiny_config, tmp_path):
    before32, after32, _ = _train_and_save(tiny_config, tmp_path, "float32")
    before16, after16, trainer = _train_and_save(tiny_config, tmp_path, "bfloat16")
    moved32, moved16 = _moves(before32, after32), _moves(before16, after16)
    assert float((moved32 != 0).float().mean()) > 0.99
    # bfloat16 weights updated in place by AdamW kept about none of these steps (lr 1e-5, weights ~0.02 and 1.0)
    assert float((moved16 != 0).float().mean()) > 0.99
    # Close in value: bfloat16 compute perturbs the gradients slightly, and AdamW's first steps (about lr x sign)
    # turn that into a sign flip only where a gradient is near zero.
    assert float(torch.nn.functional.cosine_similarity(moved32, moved16, dim=0)) > 0.9
    assert float((torch.sign(moved32) == torch.sign(moved16)).float().mean()) > 0.9
    assert abs(float(moved16.norm() / moved32.norm()) - 1) < 0.05
    model = trainer.team[0].model  # float32 master weights, bfloat16 compute
    assert next(model.parameters()).dtype == torch.float32 and compute_dtype(model) == torch.bfloat16


def test_lora_adapters_stay_float32_on_a_bfloat16_base(tiny_config, tmp_path):
    """PEFT keeps adapters in float32 on a 16-bit base (autocast_adapter_dtype), for every agent's adapter."""
    config = tiny_config(steps=1, team={"training": "lora", "dtype": "bfloat16"}, optim={"lr": 1e-5})
    with Trainer(config) as trainer:
        model = trainer.team[0].model
        assert model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.bfloat16
        for agent in trainer.team:
            assert {p.dtype for p in agent.parameters} == {torch.float32}
        names = {id(p): name for name, p in model.named_parameters()}
        before = [{names[id(p)]: p.detach().clone() for p in agent.parameters} for agent in trainer.team]
        trainer.train_step()
        for agent, old in zip(trainer.team, before):
            moved = torch.cat([(p.detach() != old[names[id(p)]]).flatten() for p in agent.parameters
                               if "lora_B" in names[id(p)]])
            assert float(moved.float().mean()) > 0.99  # B starts at zero: every entry's first step is kept
