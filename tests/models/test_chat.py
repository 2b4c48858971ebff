"""What the chat template decides: the token that ends a turn (a stop token even when the configured eos is
another), and the template's thinking option, rendered alike in training, evaluation, serving and export."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from teamrl.config import SamplingConfig
from teamrl.models.chat import end_of_turn_ids, stop_token_ids
from teamrl.models.tiny import tiny_model
from teamrl.rollout.generate import generate
from teamrl.team import Agent, Team

#: The end of Qwen3's chat template (Qwen/Qwen3-1.7B tokenizer_config.json): the generation prompt, and with
#: enable_thinking false an empty thinking block; every turn closed by <|im_end|>.
QWEN_LIKE_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
WORDS = "target 9 first second hello teamrl-end-of-turn-probe Hello. <think> </think> system user assistant".split()


def qwen_like_tokenizer() -> PreTrainedTokenizerFast:
    """As Qwen2.5-Coder-3B's: eos (and pad) <|endoftext|>, while the chat template ends every turn with <|im_end|>."""
    vocab = {token: index for index, token in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>",
                                                          *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>", unk_token="<unk>",
                                        additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = QWEN_LIKE_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def qwen_like_agent(**options) -> Agent:
    tokenizer = qwen_like_tokenizer()
    model = tiny_model(len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return Agent(name="a", model=model, tokenizer=tokenizer, sampling=SamplingConfig(max_new_tokens=6), **options)


def test_the_turn_end_of_the_template_is_a_stop_token_when_the_configured_eos_is_another():
    tokenizer = qwen_like_tokenizer()
    eos, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert tokenizer.eos_token_id == eos != im_end
    assert end_of_turn_ids(tokenizer) == [im_end]
    agent = qwen_like_agent()
    assert agent.model.generation_config.eos_token_id == eos
    assert agent.eos_token_ids == sorted([eos, im_end])


def test_generation_stops_at_the_turn_end():
    """A model that always writes <|im_end|> first: its completions are that one token, and sampling stops there
    instead of running on to max_new_tokens past the end of the answer."""
    agent = qwen_like_agent()
    im_end = agent.tokenizer.convert_tokens_to_ids("<|im_end|>")
    head = torch.nn.Linear(agent.model.config.hidden_size, len(agent.tokenizer), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-30.0)
        head.bias[im_end] = 30.0
    agent.model.lm_head = head
    gen = generate(agent, [agent.prompt("target 9 first")], 2, seed=0)
    assert gen.completion_ids.shape[1] == 1 and gen.completion_ids[:, 0].tolist() == [im_end, im_end]
    assert gen.completion_mask.tolist() == [[1], [1]]


def test_templates_without_a_closing_special_token_add_none():
    tokenizer = qwen_like_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_ids(tokenizer) == []
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"  # a template with rules of its own
    assert end_of_turn_ids(tokenizer) == []
    assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id]


def test_thinking_is_off_by_default_and_each_agent_may_turn_it_on(tiny_config):
    config = tiny_config(team={"agents": [{"name": "first"}, {"name": "second", "enable_thinking": True}]})
    assert config.team.enable_thinking is False
    assert [config.team.agent_enable_thinking(i) for i in range(2)] == [False, True]
    off, on, template_default = (qwen_like_agent(enable_thinking=value) for value in (False, True, None))
    assert off.prompt("hello").endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.prompt("hello").endswith("<|im_start|>assistant\n") == template_default.prompt("hello").endswith(
        "<|im_start|>assistant\n") is True
    assert Agent(name="a", model=None, tokenizer=qwen_like_tokenizer(), sampling=SamplingConfig()).enable_thinking \
        is False


def test_the_saved_team_serves_and_exports_with_the_option_it_was_trained_with(tmp_path):
    """The option travels in team.json; the server's chat prompts and the export's cards render with it."""
    from teamrl.envs.digit_sum import DigitSumGame
    from teamrl.export import _AgentEntry, _prompt_text, _template_options

    agent = qwen_like_agent(enable_thinking=False)
    agent.base_spec = "x"
    Team([agent]).save_pretrained(tmp_path / "team")
    entry = json.loads((tmp_path / "team" / "team.json").read_text())["agents"][0]
    assert entry["enable_thinking"] is False
    exported = _AgentEntry(name="a", kind="full", base_spec="x", system_prompt=None, use_chat_template=True,
                           sampling=entry["sampling"], enable_thinking=entry["enable_thinking"],
                           tokenizer=agent.tokenizer, uses_chat_template=True)
    assert _prompt_text(exported, "hello") == agent.prompt("hello")
    assert _template_options(exported) == {"enable_thinking": False}
    pytest.importorskip("fastapi")
    from teamrl.serve.engine import ServedTeam

    served = ServedTeam(Team([agent]), DigitSumGame(), "t")
    assert served.chat_prompt(agent, [{"role": "user", "content": "hello"}]) == agent.prompt("hello")


def test_a_team_saved_before_the_option_keeps_its_templates_default(tiny_config, tmp_path):
    from teamrl.train import Trainer

    with Trainer(tiny_config(steps=1)) as trainer:
        saved = trainer.save_team(tmp_path / "team")
    manifest = json.loads((saved / "team.json").read_text())
    assert [entry["enable_thinking"] for entry in manifest["agents"]] == [False, False]
    assert [agent.enable_thinking for agent in Team.from_pretrained(saved)] == [False, False]
    for entry in manifest["agents"]:
        del entry["enable_thinking"]
    (saved / "team.json").write_text(json.dumps(manifest))
    assert [agent.enable_thinking for agent in Team.from_pretrained(saved)] == [None, None]
