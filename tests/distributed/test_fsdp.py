"""``distributed.backend: fsdp`` on a CPU: torchrun ranks with gloo, every model sharded with FSDP2's fully_shard.

Two ranks train a tiny two-agent LoRA team (both adapters on one sharded base) as one process trains it: the same
samples, losses within 1e-5, weights within 1e-5 after two steps; rank 0 alone writes the run, and the saved team
loads in one process. A group of one (no torchrun) resumes a sharded checkpoint exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from teamrl.config import ConfigError, config_from_dict
from teamrl.team import Team
from teamrl.train import Trainer

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _config(tiny_config_data, run_dir: Path, backend: str, **overrides) -> dict:
    """Two LoRA agents on one tiny base; micro-batches of 3 rows, so that the ranks' shares differ in size (8 rows
    an agent: 3 micro-batches, rank 1 running one of its own again at weight 0)."""
    return tiny_config_data(steps=2, items_per_step=2, algorithm={"num_generations": 4},
                            team={"training": "lora", "onednn_linear": False, "sampling": {"max_new_tokens": 4},
                                  "agents": [{"name": "first"}, {"name": "second"}]},
                            optim={"lr": 1e-3, "micro_batch_size": 3}, run_dir=str(run_dir),
                            logging={"progress_bar": False, "sample_every": 0}, distributed={"backend": backend},
                            **overrides)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun (torch's launcher) is not on PATH")
def test_two_ranks_train_as_one_process_does_and_the_saved_team_loads_in_one(tiny_config_data, tmp_path):
    sharded = tmp_path / "sharded.yaml"
    sharded.write_text(yaml.safe_dump(_config(tiny_config_data, tmp_path / "sharded", "fsdp")))
    result = subprocess.run(["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "teamrl.cli", "train",
                             str(sharded)], capture_output=True, text=True, timeout=600, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]

    single = config_from_dict(_config(tiny_config_data, tmp_path / "single", "local"))
    with Trainer(single) as trainer:
        trainer.train()
        trainer.save_team()
    ours, theirs = _metrics(tmp_path / "sharded"), _metrics(tmp_path / "single")
    assert len(ours) == 2  # rank 0 alone logs
    for mine, one in zip(ours, theirs):
        assert mine["reward/mean"] == one["reward/mean"]  # the same samples
        for key in ("loss", "first/loss", "second/loss", "first/grad_norm", "second/grad_norm"):
            assert mine[key] == pytest.approx(one[key], abs=1e-5), key
    assert sorted(p.name for p in (tmp_path / "sharded" / "checkpoints").iterdir()) == ["latest", "step_000002"]
    worst = 0.0
    for agent in ("first", "second"):
        mine = load_file(str(tmp_path / "sharded" / "team" / agent / "adapter_model.safetensors"))
        one = load_file(str(tmp_path / "single" / "team" / agent / "adapter_model.safetensors"))
        assert mine.keys() == one.keys()
        worst = max(worst, *(float((mine[k] - one[k]).abs().max()) for k in mine))
    assert worst < 1e-5
    moved = load_file(str(tmp_path / "sharded" / "team" / "first" / "adapter_model.safetensors"))
    assert any(float(v.abs().max()) > 1e-4 for k, v in moved.items() if "lora_B" in k)  # the steps did train

    team = Team.from_pretrained(tmp_path / "sharded" / "team")  # one process, no torch.distributed
    assert [agent.name for agent in team] == ["first", "second"]
    state = dict(team[0].model.named_parameters())
    key = next(k for k in moved if "lora_B" in k)
    loaded = next(p for n, p in state.items() if n.endswith(key.replace(".weight", ".agent_first.weight")))
    assert float((loaded.detach() - moved[key]).abs().max()) == 0.0


@pytest.mark.slow
def test_a_group_of_one_resumes_a_sharded_checkpoint_exactly(tiny_config_data, tmp_path):
    """Without torchrun the backend is a group of one: its checkpoint (gathered in full) loads back into the
    shards and the resumed step is the uninterrupted one, bit for bit."""
    config = tmp_path / "sharded.yaml"
    config.write_text(yaml.safe_dump(_config(tiny_config_data, tmp_path / "run", "fsdp",
                                             checkpoint={"save_every": 1})))
    script = f"""
import json
from teamrl.config import load_config
from teamrl.train import Trainer
config = load_config({str(config)!r})
with Trainer(config) as trainer:
    trainer.train_step()
    trainer.save()
    straight = trainer.train_step()
    weights = [{{k: v.tolist() for k, v in s.parameters.items()}} for s in trainer.agents.states()]
with Trainer(config, resume=True) as trainer:
    resumed = trainer.train_step()
    again = [{{k: v.tolist() for k, v in s.parameters.items()}} for s in trainer.agents.states()]
print(json.dumps([straight["loss"], resumed["loss"], weights == again]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    straight, resumed, same = json.loads(result.stdout.strip().splitlines()[-1])
    assert straight == resumed and same


@pytest.mark.parametrize("overrides,field", [
    ({"algorithm": {"name": "iac"}}, "algorithm.name"),
    ({"algorithm": {"name": "marlhf"}}, "algorithm.name"),
    ({"team": {"training": "full"}, "algorithm": {"kl_coef": 0.1}}, "algorithm.kl_coef"),
])
def test_what_fsdp_does_not_shard_is_refused_when_the_config_loads(tiny_config_data, tmp_path, overrides, field):
    data = tiny_config_data(distributed={"backend": "fsdp"}, **overrides)
    with pytest.raises(ConfigError, match=rf"^{field}: must be .*distributed.backend='fsdp'"):
        config_from_dict(data)
