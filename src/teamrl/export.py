"""Export a saved team for tools that know nothing of teamrl: ``teamrl export TEAM --out DIR``.

:func:`export_team` reads a team written by :meth:`teamrl.team.Team.save_pretrained` (``RUN_DIR/team``) and
writes, into ``OUT``::

    OUT/README.md     the team's model card: roles, prompts, task and reward, training, how to run it
    OUT/team.json     the team's manifest, pointing at this export (teamrl loads it like a saved team)
    OUT/base/         format "peft", LoRA teams: the base model the adapters apply to, a plain checkpoint
    OUT/AGENT/        one folder per agent, each a self-contained Hugging Face repo (what ``push_to_hub`` and
                      ``huggingface_hub.upload_folder`` take): README.md with YAML front matter, the weights,
                      the tokenizer and a generation_config.json holding the agent's sampling settings

In format ``peft`` a LoRA agent's folder is its PEFT adapter, whose ``base_model_name_or_path`` is the
absolute path of ``OUT/base`` (transformers resolves a relative one against the working directory, not the
adapter), or exactly the ``base_path`` given (where the base will live once moved or pushed to the hub). In
format ``merged`` it is a plain checkpoint: the adapter merged into a copy of its base. A fully fine-tuned
agent is a plain checkpoint in both formats.

Everything is written into a hidden sibling of ``OUT`` and renamed into place at the end, so a failed
export leaves nothing half-written behind.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from teamrl import __version__
from teamrl.imports import load_object
from teamrl.run_dir import CONFIG_FILE, EVAL_FILE, METRICS_FILE, TEAM_DIR, read_records

FORMATS = ("peft", "merged")
#: The tags every exported model card carries, so a team's repos can be found together on the hub.
CARD_TAGS = ["teamrl", "multi-agent", "magrpo"]
MANIFEST_FILE = "team.json"
CARD_FILE = "README.md"
BASE_DIR = "base"


class ExportError(ValueError):
    """The export cannot be done as asked; the one-line message names the path or flag and what to do."""


@dataclass
class _AgentEntry:
    """One agent as ``team.json`` records it, with what the export learns about it."""

    name: str
    kind: str
    base_spec: str
    system_prompt: str | None
    use_chat_template: bool
    sampling: dict[str, Any]
    enable_thinking: bool | None = None
    """The chat template's ``enable_thinking`` option it was trained with (None: the template's default)."""
    tokenizer: Any = None
    uses_chat_template: bool = False
    """Whether its prompts go through the tokenizer's chat template (asked for, and the tokenizer has one)."""
    base_folder: str | None = None
    """Format peft, LoRA agents: the export's folder holding its base."""
    base_reference: str | None = None
    """Format peft, LoRA agents: its adapter's ``base_model_name_or_path``."""


def export_team(team_dir: str | Path, out: str | Path, *, format: str = "peft", base_path: str | None = None,
                overwrite: bool = False) -> Path:
    """Export the team saved in ``team_dir`` to ``out`` for plain transformers/peft (see the module docstring).

    Args:
        team_dir: a directory written by :meth:`~teamrl.team.Team.save_pretrained` (``RUN_DIR/team``).
        out: the folder to write; it must not exist or be empty, unless ``overwrite``.
        format: ``"peft"`` (LoRA adapters beside one copy of their base) or ``"merged"`` (a full checkpoint
            per agent).
        base_path: format ``peft`` only: what every adapter's ``base_model_name_or_path`` says instead of
            ``OUT/base``'s absolute path: a hub id or path where the base will be found after the export is
            moved or pushed. ``OUT/base`` is written all the same.
        overwrite: replace ``out`` if it holds an earlier export (never a folder of anything else).

    Returns:
        ``out``.

    Raises:
        ExportError: ``team_dir`` is not a saved team, ``out`` cannot be written, a base cannot be loaded, or
            the arguments do not fit the team; the message is one line.
    """
    if format not in FORMATS:
        raise ExportError(f"--format: {format!r} is not one of {', '.join(FORMATS)}")
    team_dir, out = Path(team_dir), Path(out)
    manifest = _read_manifest(team_dir)
    agents = [_AgentEntry(name=entry["name"], kind=entry["kind"], base_spec=entry["base_model"],
                          system_prompt=entry.get("system_prompt"),
                          use_chat_template=entry.get("use_chat_template", True), sampling=entry["sampling"],
                          enable_thinking=entry.get("enable_thinking"))
              for entry in manifest["agents"]]
    lora_bases = list(dict.fromkeys(agent.base_spec for agent in agents if agent.kind == "lora"))
    if base_path is not None:
        if format != "peft":
            raise ExportError("--base-path: only --format peft refers to a base model; merged checkpoints hold theirs")
        if len(lora_bases) != 1:
            raise ExportError(f"--base-path: the team has {len(lora_bases)} LoRA base models ({', '.join(lora_bases)}"
                              f"); one path can name only one")
    _check_out(out, team_dir, overwrite)

    env, env_problem = _rebuild_env(manifest)
    for agent in agents:
        agent.tokenizer = _agent_tokenizer(team_dir / agent.name)
        agent.uses_chat_template = bool(agent.use_chat_template and getattr(agent.tokenizer, "chat_template", None))

    bases = {spec: _load_base(spec, manifest, env, env_problem) for spec in lora_bases}

    staging = out.parent / f".{out.name}.export-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    except OSError as err:
        raise ExportError(f"--out: cannot write in {out.parent} ({err.strerror or err})") from None
    try:
        if format == "peft":
            _assign_base_folders(agents, lora_bases, out, base_path)
            for spec in lora_bases:
                users = [a for a in agents if a.kind == "lora" and a.base_spec == spec]
                _write_base(*bases[spec], staging / users[0].base_folder, spec, users)
        for index, agent in enumerate(agents):
            target = staging / agent.name
            if agent.kind == "full":
                _write_full_agent(team_dir / agent.name, target, agent)
            elif format == "peft":
                _write_adapter(team_dir / agent.name, target, agent, bases[agent.base_spec][0])
            else:
                _write_merged_agent(team_dir / agent.name, target, agent, bases[agent.base_spec][0])
            hub_base = _hub_base(agent, format, base_path)
            _write_text(target / CARD_FILE, _agent_card(agent, index, agents, manifest, format, hub_base, env,
                                                        out / agent.name))
        _write_text(staging / MANIFEST_FILE, json.dumps(_export_manifest(manifest, agents, team_dir, format),
                                                        indent=2))
        _write_text(staging / CARD_FILE, _team_card(team_dir, manifest, agents, format, base_path, env, env_problem,
                                                    out))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except OSError as err:  # a full disk, a folder made read-only meanwhile: one line, nothing half-written
        raise ExportError(f"--out: writing {out} failed ({type(err).__name__}: {err})") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------------
# Checks before anything is loaded


def _read_manifest(team_dir: Path) -> dict[str, Any]:
    """``team_dir``'s ``team.json``, checked to describe agents whose folders are there."""
    manifest_file = team_dir / MANIFEST_FILE
    if not manifest_file.is_file():
        hint = (f"its {TEAM_DIR}/ is one" if (team_dir / TEAM_DIR / MANIFEST_FILE).is_file()
                else f"give the directory training wrote, RUN_DIR/{TEAM_DIR}")
        raise ExportError(f"TEAM: {str(team_dir)!r} is not a saved team (no {MANIFEST_FILE}); {hint}")
    manifest = _json_or_empty(manifest_file)
    entries = manifest.get("agents")
    required = ("name", "kind", "base_model", "sampling")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and all(k in e for k in required) for e in entries):
        raise ExportError(f"TEAM: {manifest_file} is not a manifest Team.save_pretrained wrote (its agents need "
                          f"{', '.join(required)})")
    for entry in entries:
        if entry["kind"] not in ("lora", "full"):
            raise ExportError(f"TEAM: {manifest_file}: agent {entry['name']!r} has kind {entry['kind']!r}, "
                              f"not lora or full")
        if not (team_dir / entry["name"]).is_dir():
            raise ExportError(f"TEAM: {team_dir / entry['name']} is missing: {MANIFEST_FILE} lists agent "
                              f"{entry['name']!r}")
    return manifest


def _check_out(out: Path, team_dir: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that would lose anything: a file, the team itself or a folder around it, and a
    non-empty folder unless ``overwrite`` and it holds an earlier export."""
    resolved, team = out.resolve(), team_dir.resolve()
    if resolved == team or resolved in team.parents:
        raise ExportError(f"--out: {out} holds the team being exported ({team_dir}); give a folder outside it")
    if out.is_file():
        raise ExportError(f"--out: {out} is a file; give a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ExportError(f"--out: {out} exists and is not empty; give a new folder, or add --overwrite to replace "
                          f"an earlier export there")
    if "export" not in _json_or_empty(out / MANIFEST_FILE):
        raise ExportError(f"--out: {out} holds files that are not a teamrl export; --overwrite replaces only an "
                          f"earlier export: give a new folder")


def _json_or_empty(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


# ------------------------------------------------------------------------------------------------
# Loading what the export needs


def _rebuild_env(manifest: dict[str, Any]):
    """The task the team was trained on (for the 'tiny' base's vocabulary and the card's example), or
    None and why not: a card can do without it."""
    from teamrl.envs.base import rebuild_env

    if "env" not in manifest:
        return None, f"{MANIFEST_FILE} names no task"
    try:
        return rebuild_env(manifest["env"]), None
    except Exception as err:  # a user's task may fail to import in any way; the export goes on without it
        return None, f"{type(err).__name__}: {_first_line(err)}"


def _agent_tokenizer(folder: Path):
    """The tokenizer saved with an agent, as teamrl prepares it for generation (pad token, left padding)."""
    from transformers import AutoTokenizer

    from teamrl.models.loading import prepare_tokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as err:
        raise ExportError(f"TEAM: {folder} holds no loadable tokenizer ({type(err).__name__}: "
                          f"{_first_line(err)})") from None
    return prepare_tokenizer(tokenizer, str(folder))


def _load_base(spec: str, manifest: dict[str, Any], env, env_problem: str | None):
    """A LoRA agent's base model and tokenizer, as plain transformers objects (teamrl's CPU kernels, which
    :func:`teamrl.team.load_base_model` switches on, stay off: the base is saved as a plain checkpoint)."""
    if spec == "tiny":
        from teamrl.models.tiny import tiny_model_and_tokenizer

        if env is None:
            raise ExportError(f"TEAM: the 'tiny' base model is built from the task's vocabulary, and the task "
                              f"cannot be built here ({env_problem})")
        return tiny_model_and_tokenizer(env.vocabulary() or [], seed=manifest.get("seed", 0))
    from teamrl.models.loading import load_model_and_tokenizer

    try:
        return load_model_and_tokenizer(spec)
    except ValueError as err:  # ModelLoadError: one line naming the spec
        raise ExportError(f"TEAM: the base model cannot be loaded: {err}") from None


def _assign_base_folders(agents: list[_AgentEntry], bases: list[str], out: Path, base_path: str | None) -> None:
    """Name each LoRA base's folder (``base``; with several bases ``base-AGENT``, after its first agent) and
    what its adapters call it."""
    names = {agent.name for agent in agents}
    for spec in bases:
        users = [agent for agent in agents if agent.kind == "lora" and agent.base_spec == spec]
        folder = BASE_DIR if len(bases) == 1 else f"{BASE_DIR}-{users[0].name}"
        while folder in names:  # an agent called "base" keeps its name
            folder += "-model"
        for agent in users:
            agent.base_folder = folder
            agent.base_reference = base_path if base_path is not None else str((out / folder).absolute())


# ------------------------------------------------------------------------------------------------
# Writing the folders


def _write_base(model, tokenizer, target: Path, spec: str, users: list[_AgentEntry]) -> None:
    """The LoRA agents' base as a plain checkpoint. Its generation_config.json holds the agents' sampling (when they
    share one): ``vllm serve`` of this folder fills every sampling field a request leaves out from it."""
    shared = all(agent.sampling == users[0].sampling for agent in users)
    model.generation_config = _with_sampling(model.generation_config, users[0].sampling if shared else
                                             {**users[0].sampling, "temperature": 1.0, "top_p": 1.0, "top_k": 0})
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    front = _front_matter("transformers", _hub_origin(spec))
    sampling_note = (f"Its `generation_config.json` holds the agents' sampling settings "
                     f"({_sampling_line(users[0].sampling)}), which `vllm serve` applies to any request that "
                     f"leaves one out." if shared else
                     "The agents sample differently, so its `generation_config.json` applies no sampling filter: "
                     "a request to `vllm serve` must send the agent's own settings (each agent's "
                     "`generation_config.json` holds them; `teamrl serve --vllm-url` sends them).")
    _write_text(target / CARD_FILE, front + textwrap.dedent(f"""
        # Base model of a teamrl team

        The frozen base model that the LoRA adapters of {_names([a.name for a in users])} apply to (teamrl model
        spec `{spec}`{_origin_note(spec)}), saved as a plain transformers checkpoint with its tokenizer. Each
        adapter's `adapter_config.json` names this folder in `base_model_name_or_path`; see the team's
        README.md.
        """) + "\n" + sampling_note + "\n")


def _write_adapter(source: Path, target: Path, agent: _AgentEntry, base_model) -> None:
    """The agent's PEFT adapter, its ``base_model_name_or_path`` set to ``agent.base_reference``."""
    target.mkdir()
    shutil.copy2(source / "adapter_model.safetensors", target / "adapter_model.safetensors")
    config = json.loads((source / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = agent.base_reference
    _write_text(target / "adapter_config.json", json.dumps(config, indent=2, sort_keys=True))
    agent.tokenizer.save_pretrained(target)
    _generation_config(base_model.generation_config, agent).save_pretrained(target)


def _write_merged_agent(source: Path, target: Path, agent: _AgentEntry, base_model) -> None:
    """The agent's adapter merged into a copy of its base (the loaded base stays clean for the next agent)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base_model), str(source)).merge_and_unload()
    model.generation_config = _generation_config(base_model.generation_config, agent)
    model.save_pretrained(target)
    agent.tokenizer.save_pretrained(target)


def _write_full_agent(source: Path, target: Path, agent: _AgentEntry) -> None:
    """A fully fine-tuned agent: its saved checkpoint as it is, with the agent's sampling settings."""
    from transformers import GenerationConfig

    shutil.copytree(source, target)
    try:
        saved = GenerationConfig.from_pretrained(source, local_files_only=True)
    except OSError:  # saved without a generation_config.json
        saved = GenerationConfig()
    _generation_config(saved, agent).save_pretrained(target)


def _generation_config(model_config, agent: _AgentEntry):
    """``model_config`` with the agent's sampling settings and every token id teamrl ends a completion at
    (:attr:`teamrl.team.Agent.eos_token_ids`): ``generate`` then samples as the team was trained to."""
    from teamrl.models.chat import stop_token_ids

    config = _with_sampling(model_config, agent.sampling)
    eos = stop_token_ids(agent.tokenizer, config)
    config.eos_token_id = eos if len(eos) != 1 else eos[0]
    if config.pad_token_id is None:
        config.pad_token_id = agent.tokenizer.pad_token_id
    return config


def _with_sampling(model_config, sampling: dict[str, Any]):
    """A copy of ``model_config`` that samples as ``sampling`` (an agent's settings) says, and nothing else: the
    filters teamrl never applies (a hub model's own, e.g. Qwen2.5-Instruct's repetition_penalty 1.05) off."""
    config = copy.deepcopy(model_config)
    config._from_model_config = False  # else generate() may replace it with the model config's settings
    config.do_sample = True
    config.temperature = sampling["temperature"]
    config.top_p = sampling["top_p"]
    config.top_k = sampling["top_k"]  # 0 turns it off, in transformers as in teamrl
    config.max_new_tokens = sampling["max_new_tokens"]
    config.min_p = None
    config.repetition_penalty = 1.0
    return config


def _export_manifest(manifest: dict[str, Any], agents: list[_AgentEntry], team_dir: Path,
                     format: str) -> dict[str, Any]:
    """The source's ``team.json`` for the export: merged agents are full models now, and LoRA agents'
    bases are what their adapters name; the ``export`` record marks the folder as an export."""
    entries = []
    for entry, agent in zip(manifest["agents"], agents):
        entry = dict(entry)
        if agent.kind == "lora" and format == "merged":
            entry["kind"] = "full"
        elif agent.kind == "lora":
            entry["base_model"] = agent.base_reference
        entries.append(entry)
    record = {"format": format, "source": str(team_dir.absolute()), "teamrl_version": __version__}
    return {**manifest, "agents": entries, "export": record}


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ------------------------------------------------------------------------------------------------
# Model cards


def _hub_origin(spec: str) -> str | None:
    """The hub model a base spec comes from, for a card's ``base_model``; None for local files and 'tiny'."""
    from teamrl.models.loading import BUNDLED_PREFIX, is_hub_id

    if spec == BUNDLED_PREFIX or spec.startswith(f"{BUNDLED_PREFIX}:"):
        from teamrl.models.bundled import get_bundled_model

        return get_bundled_model(spec.partition(":")[2] or None).origin or None
    return spec if spec != "tiny" and is_hub_id(spec) else None


def _hub_base(agent: _AgentEntry, format: str, base_path: str | None) -> str | None:
    """An agent card's ``base_model``: the hub repo ``--base-path`` names, else where its base came from."""
    from teamrl.models.loading import is_hub_id

    if format == "peft" and agent.kind == "lora" and base_path is not None and is_hub_id(base_path):
        return base_path
    return _hub_origin(agent.base_spec)


def _origin_note(spec: str) -> str:
    from teamrl.models.loading import BUNDLED_PREFIX

    origin = _hub_origin(spec)
    if spec == BUNDLED_PREFIX or spec.startswith(f"{BUNDLED_PREFIX}:"):
        return f": {origin}, dequantised from the GGUF teamrl ships, so not the hub's weights exactly"
    if spec == "tiny":
        return ": a tiny random Llama over the task's words, for tests"
    return ""


def _front_matter(library: str, base_model: str | None) -> str:
    """A model card's YAML front matter, the metadata the hub reads."""
    import yaml

    data: dict[str, Any] = {"library_name": library}
    if base_model:
        data["base_model"] = base_model
    data["pipeline_tag"] = "text-generation"
    data["tags"] = list(CARD_TAGS)
    return f"---\n{yaml.safe_dump(data, sort_keys=False)}---\n"


def _names(names: list[str]) -> str:
    quoted = [f"`{name}`" for name in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _loader(agent: _AgentEntry, format: str) -> str:
    """The class that loads the agent's exported folder."""
    return "AutoPeftModelForCausalLM" if agent.kind == "lora" and format == "peft" else "AutoModelForCausalLM"


def _imports(loaders: set[str]) -> str:
    lines = ["from peft import AutoPeftModelForCausalLM"] if "AutoPeftModelForCausalLM" in loaders else []
    names = sorted({"AutoTokenizer", "GenerationConfig"} | (loaders & {"AutoModelForCausalLM"}))
    return "\n".join([*lines, f"from transformers import {', '.join(names)}"])


# How every agent's prompt is built and answered, as teamrl builds and generates it (Agent.prompt,
# encode_prompts, decode_completions); the cards' snippets and the export's tests run exactly this code.
_ANSWER_FUNCTIONS = '''

def prompt_of(tokenizer, system_prompt, chat_template, observation):
    """The agent's prompt, as in training, and whether the tokenizer adds its special tokens to it.
    chat_template: the options its chat template was rendered with (e.g. enable_thinking), None for plain text."""
    if chat_template is not None:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": observation})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **chat_template), False
    return (f"{system_prompt}\\n\\n{observation}" if system_prompt else observation), True


def answer(path, model_class, system_prompt, chat_template, observation, **generate_options):
    """One agent's answer to its observation (generate_options, e.g. do_sample=False, override its sampling)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = model_class.from_pretrained(path)
    prompt, special_tokens = prompt_of(tokenizer, system_prompt, chat_template, observation)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=special_tokens)
    settings = GenerationConfig.from_pretrained(path)  # the agent's sampling settings and end tokens
    settings.update(**generate_options)
    output = model.generate(**inputs, generation_config=settings)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
'''


def _example_observations(env) -> tuple[str, list[str]] | None:
    """An item of the task's held-out split (else its first) and what each agent observes of it."""
    if env is None:
        return None
    try:
        split = "eval" if "eval" in env.splits else next(iter(env.splits))
        item = env.items(split)[0]
        return str(item.get("id", f"{split}-0")), list(env.observe(item))
    except Exception:  # a task without items or observations: the card shows none
        return None


def _prompt_text(agent: _AgentEntry, observation: str) -> str:
    """Agent ``agent``'s prompt of ``observation``, built by teamrl's own :meth:`teamrl.team.Agent.prompt`."""
    from teamrl.config import SamplingConfig
    from teamrl.team import Agent

    return Agent(name=agent.name, model=None, tokenizer=agent.tokenizer, sampling=SamplingConfig(**agent.sampling),
                 system_prompt=agent.system_prompt, use_chat_template=agent.use_chat_template,
                 enable_thinking=agent.enable_thinking).prompt(observation)


def _template_options(agent: _AgentEntry) -> dict[str, bool] | None:
    """The card snippets' ``chat_template`` argument: the options the agent's chat template renders with (as
    :func:`teamrl.models.chat.render_chat` passes them), or None for a plain-text prompt."""
    if not agent.uses_chat_template:
        return None
    return {} if agent.enable_thinking is None else {"enable_thinking": agent.enable_thinking}


def _prompt_description(agent: _AgentEntry, index: int, manifest: dict[str, Any]) -> str:
    task = manifest.get("env", {}).get("name", "the task")
    role = "the system prompt above" if agent.system_prompt else "no system prompt"
    source = f"the observation the task `{task}` gives seat {index + 1} of an item (`observe(item)[{index}]`)"
    if agent.uses_chat_template:
        return (f"The tokenizer's chat template over a system message ({role}) and a user message, {source}, "
                f"with the generation prompt added; tokenized without adding special tokens.")
    joined = "the system prompt, a blank line and " if agent.system_prompt else ""
    return f"Plain text (the tokenizer has no chat template, or the team was trained without it): {joined}{source}."


def _fenced(text: str, language: str = "text") -> str:
    fence = "````" if "```" in text else "```"
    return f"{fence}{language}\n{text}\n{fence}"


def _sampling_line(sampling: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value}" for key, value in sampling.items())


def _agent_card(agent: _AgentEntry, index: int, agents: list[_AgentEntry], manifest: dict[str, Any], format: str,
                hub_base: str | None, env, folder: Path) -> str:
    library = "peft" if _loader(agent, format) == "AutoPeftModelForCausalLM" else "transformers"
    what = {"AutoPeftModelForCausalLM": f"a LoRA adapter (PEFT) on the base model `{agent.base_reference}`",
            "AutoModelForCausalLM": "a full transformers checkpoint"
            + (" (its LoRA adapter merged into its base)" if agent.kind == "lora" else " (fully fine-tuned)")}
    task = manifest.get("env", {}).get("name", "its task")
    teammates = [a.name for a in agents if a is not agent]
    example = _example_observations(env)
    observation = example[1][index] if example and index < len(example[1]) else "..."
    lines = [
        _front_matter(library, hub_base),
        f"# {agent.name}: agent {index + 1} of {len(agents)} of a teamrl team",
        "",
        f"One agent of a team trained with multi-agent RL ({manifest.get('algorithm', 'magrpo').upper()}, "
        f"teamrl) on the task `{task}`, together with {_names(teammates) if teammates else 'no one'}. "
        f"At inference each agent answers its own prompt, with no controller; the team's card (README.md of the "
        f"export's root) describes the task, the reward and the training.",
        "",
        f"This folder is {what[_loader(agent, format)]}, with its tokenizer and a `generation_config.json` holding "
        f"its sampling settings ({_sampling_line(agent.sampling)}).",
        "",
        "## Role (system prompt)",
        "",
        _fenced(agent.system_prompt or "(none)"),
        "",
        "## Prompt",
        "",
        _prompt_description(agent, index, manifest),
    ]
    if example:
        lines += ["", f"For the task's item `{example[0]}`, the prompt is exactly:", "",
                  _fenced(_prompt_text(agent, observation))]
    lines += [
        "",
        "## How to run",
        "",
        "With transformers and peft only (no teamrl). Once pushed to the hub, replace the path by the repo id"
        + (" (and re-export with `--base-path` naming the base's repo)." if library == "peft" else "."),
        "",
        _fenced(_imports({_loader(agent, format)}) + "\n" + _ANSWER_FUNCTIONS + "\n" + textwrap.dedent(f"""
            agent = {str(folder.absolute())!r}
            system_prompt = {agent.system_prompt!r}
            observation = {observation!r}
            print(answer(agent, {_loader(agent, format)}, system_prompt, {_template_options(agent)!r}, observation))
            """).rstrip(), "python"),
        "",
    ]
    return "\n".join(lines)


def _run_summary(team_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """The training summary: ``team.json``'s record, and the run's own files when the team is RUN_DIR/team."""
    lines = [f"- algorithm: `{manifest.get('algorithm', 'unknown')}`; training steps: "
             f"{manifest.get('step', 'unknown')}; seed: {manifest.get('seed', 'unknown')}"]
    run_dir = team_dir.parent
    if team_dir.name != TEAM_DIR:
        return lines
    steps = read_records(run_dir / METRICS_FILE)
    rewards = [(step["step"], step["reward/mean"]) for step in steps if "reward/mean" in step and "step" in step]
    if rewards:
        last = rewards[-5:]
        mean = sum(reward for _, reward in last) / len(last)
        lines.append(f"- training joint reward (the mean over a step's sampled joint actions): {rewards[0][1]:.3f} at "
                     f"step {rewards[0][0]}" + (f" -> {rewards[-1][1]:.3f} at step {rewards[-1][0]} (mean of the last "
                                                f"{len(last)} steps: {mean:.3f})" if len(rewards) > 1 else ""))
    evaluations = [e for e in read_records(run_dir / EVAL_FILE) if "reward/mean" in e]
    if evaluations:
        first, last = evaluations[0], evaluations[-1]
        lines.append(f"- held-out joint reward ({last.get('items', '?')} items x {last.get('samples', '?')} samples of "
                     f"the task's eval split): {first['reward/mean']:.3f} at step {first.get('step', '?')} -> "
                     f"{last['reward/mean']:.3f} at step {last.get('step', '?')}")
    if (run_dir / CONFIG_FILE).is_file():
        lines += ["", f"<details><summary>The run's {CONFIG_FILE}</summary>", "",
                  _fenced((run_dir / CONFIG_FILE).read_text().rstrip(), "yaml"), "", "</details>"]
    return lines


def _task_description(env, manifest: dict[str, Any], env_problem: str | None) -> list[str]:
    record = manifest.get("env")
    if record is None:
        return ["The team's `team.json` records no task."]
    lines = [f"The task `{record['name']}`, built with these arguments (`env` in `team.json`):", "",
             _fenced(json.dumps(record.get("kwargs", {}), indent=2), "json"), ""]
    if env is None:
        lines.append(f"(The task could not be built here to describe it: {env_problem}.)")
        return lines
    doc = _summary(type(env))
    if doc:
        lines += [f"`{type(env).__name__}`: {doc}", ""]
    # The reward's own words where a user wrote them (the dataset task's reward function, a task class's method);
    # teamrl's docstrings of its built-in tasks speak of its internals.
    function = env.function_behind("joint_reward")
    if function is not None:
        scorer, reward_doc = f"reward function `{function}`", _summary(_object_or_none(function))
    else:
        method = type(env).joint_reward
        scorer = "`joint_reward(item, actions)`"
        reward_doc = "" if method.__module__.partition(".")[0] == "teamrl" else _summary(method)
    lines.append(f"Reward: one joint reward for all agents, the task's {scorer} of the agents' outputs in seat order "
                 f"(at most {getattr(env, 'max_reward', 1.0)} a turn)" + (f": {reward_doc}" if reward_doc else "."))
    return lines


def _summary(obj: Any) -> str:
    """The first paragraph of ``obj``'s own docstring (not one it inherits) on one line, its reST markup (``code``,
    :class:`Name`) as Markdown."""
    paragraph = " ".join(inspect.cleandoc(getattr(obj, "__doc__", None) or "").split("\n\n")[0].split())
    return re.sub(r"(?::\w+:)?``?~?([^`]+?)``?", r"`\1`", paragraph)


def _object_or_none(path: str) -> Any:
    try:
        return load_object(path, "reward")
    except ValueError:
        return None


def _team_card(team_dir: Path, manifest: dict[str, Any], agents: list[_AgentEntry], format: str,
               base_path: str | None, env, env_problem: str | None, out: Path) -> str:
    hubs = {_hub_base(agent, format, base_path) for agent in agents}
    hub_base = next(iter(hubs)) if len(hubs) == 1 else None
    adapters = any(_loader(agent, format) == "AutoPeftModelForCausalLM" for agent in agents)
    library = "peft" if adapters else "transformers"
    example = _example_observations(env)
    lines = [
        _front_matter(library, hub_base),
        f"# A teamrl team of {len(agents)} agents: {_names([agent.name for agent in agents])}",
        "",
        "A team of language models trained together with multi-agent reinforcement learning by teamrl: every "
        "agent learned from one shared joint reward. At inference the agents run decentralised: each answers its "
        "own prompt, concurrently, with no controller, and the team's answer is their outputs in seat order.",
        "",
        f"Exported by `teamrl export` (teamrl {__version__}, format `{format}`) from `{team_dir.absolute()}`.",
        "",
        "## Layout",
        "",
    ]
    for folder in dict.fromkeys(agent.base_folder for agent in agents if agent.base_folder):
        users = [a.name for a in agents if a.base_folder == folder]
        lines.append(f"- `{folder}/`: the base model of {_names(users)}, a plain transformers checkpoint "
                     f"(model spec `{next(a.base_spec for a in agents if a.base_folder == folder)}`).")
    for agent in agents:
        kind = _loader(agent, format) == "AutoPeftModelForCausalLM"
        lines.append(f"- `{agent.name}/`: " + (f"a LoRA adapter; `base_model_name_or_path`: `{agent.base_reference}`"
                                               if kind else "a full checkpoint"
                                               + (" (adapter merged)" if agent.kind == "lora" else ""))
                     + ", tokenizer, generation_config.json (sampling), README.md (its card).")
    lines += [
        f"- `{MANIFEST_FILE}`: the team for teamrl (`Team.from_pretrained`, `teamrl generate`).",
        "",
        "Each agent's folder is a self-contained Hugging Face repo: push it with `huggingface_hub.upload_folder`"
        + (" (a pushed adapter must name a base others can load: re-export with `--base-path OWNER/REPO`, the"
           " repo you push `base/` to)." if library == "peft" and base_path is None else "."),
        "",
        "## Roles and prompts",
        "",
        "| seat | agent | role (system prompt) | prompt | sampling |",
        "|---|---|---|---|---|",
    ]
    for index, agent in enumerate(agents):
        prompt = "chat template" if agent.uses_chat_template else "plain text"
        role = (agent.system_prompt or "(none)").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {index + 1} | `{agent.name}` | {role} | {prompt} | {_sampling_line(agent.sampling)} |")
    lines += ["", "Agent i's prompt is built from the task's observation for seat i, `observe(item)[i]`: through "
                  "the tokenizer's chat template (a system message with the role, a user message with the "
                  "observation, the generation prompt added, the template's options as trained, e.g. "
                  "`enable_thinking`; tokenized without adding special tokens), or as plain "
                  "text (the role, a blank line and the observation) where the agent has no chat template. Each "
                  "agent's card shows its exact prompt of an example item.", "",
              "## Task and reward", ""]
    lines += _task_description(env, manifest, env_problem)
    lines += ["", "## Training", ""]
    lines += _run_summary(team_dir, manifest)
    observations = example[1] if example else ["..." for _ in agents]
    rows = "\n".join(f"    ({str((out / a.name).absolute())!r}, {_loader(a, format)}, {a.system_prompt!r}, "
                     f"{_template_options(a)!r})," for a in agents)
    snippet = _imports({_loader(agent, format) for agent in agents}) + "\n" + _ANSWER_FUNCTIONS + "\n" + (
        f"AGENTS = [  # (folder, model class, system prompt, chat template options or None) in seat order\n"
        f"{rows}\n]\n"
        f"observations = {observations!r}  # one per agent: the task's observe(item)\n"
        "# The agents are independent: run them in parallel (threads, processes, servers) as you like.\n"
        "outputs = [answer(*agent, observation) for agent, observation in zip(AGENTS, observations)]\n"
        "print(outputs)")
    lines += ["", "## How to run", "",
              "With transformers and peft only (no teamrl)"
              + (f", on the task's item `{example[0]}`" if example else "") + ":", "",
              _fenced(snippet, "python"), ""]
    return "\n".join(lines)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
