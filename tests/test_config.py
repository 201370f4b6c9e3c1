from pathlib import Path

import pytest

from quickstart.config import QuickstartConfig, ToolsConfig, VideoConfig, config_class
from vagent.config import CONFIGS, ConfigError, TinyModelConfig, load_config

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# configs/<stage>/ -> its config class: the library's stages, and the quickstart (a leaf outside the library)
STAGES = {**CONFIGS, "quickstart": QuickstartConfig}
YAMLS = sorted(p for p in CONFIG_DIR.rglob("*.yaml") if p.parent.name in STAGES)


def test_every_yaml_in_configs_loads_and_starts_with_its_launch_command():
    all_yamls = sorted(CONFIG_DIR.rglob("*.yaml"))
    assert all_yamls, "configs/ holds no YAML"
    assert YAMLS == all_yamls, "every configs/<stage>/ must be a key of vagent.config.CONFIGS (or the quickstart)"
    for path in all_yamls:  # a quickstart YAML names its proof (task: crop or video)
        cls = config_class(str(path), []) if path.parent.name == "quickstart" else STAGES[path.parent.name]
        load_config(cls, path)
        assert path.read_text().startswith("# Launch:"), f"{path} must start with its launch command"


def test_every_field_has_a_help_string():
    import dataclasses
    import typing

    seen = []

    def walk(cls):
        seen.append(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help string"
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name])

    for cls in (*STAGES.values(), VideoConfig, ToolsConfig):
        walk(cls)
    assert {c.__name__ for c in seen} >= {"ModelConfig", "RolloutConfig", "TinyModelConfig"}  # nested ones visited


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_unknown_key_is_an_error_naming_key_and_file(tmp_path):
    path = _write(tmp_path, "seed: 1\nrollout:\n  max_turn: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(QuickstartConfig, path)
    assert "rollout.max_turn" in str(e.value) and str(path) in str(e.value) and "max_turns" in str(e.value)


def test_wrong_type_is_an_error_naming_key_expected_and_given(tmp_path):
    path = _write(tmp_path, "seed: one\n")
    with pytest.raises(ConfigError, match=r"c\.yaml.*'seed' expects an integer, got str 'one'"):
        load_config(QuickstartConfig, path)
    with pytest.raises(ConfigError, match="'rollout.temperature' expects a number"):
        load_config(QuickstartConfig, None, ["rollout.temperature=hot"])
    with pytest.raises(ConfigError, match="'tiny.family' must be one of"):
        load_config(QuickstartConfig, None, ["tiny.family=llama"])
    with pytest.raises(ConfigError, match="expects true/false|expects an integer"):
        load_config(QuickstartConfig, None, ["seed=true"])  # bools are not ints


def test_overrides_nested_and_typed():
    cfg = load_config(
        QuickstartConfig,
        None,
        ["rollout.max_turns=7", "model.path=/x", "warmup_phases=[grounding]", "warmup_epochs=[1]", "seed=3"],
    )
    assert (
        cfg.rollout.max_turns == 7 and cfg.model.path == "/x" and cfg.warmup_phases == ["grounding"] and cfg.seed == 3
    )
    assert cfg.rollout.temperature == 0.7  # untouched defaults survive (the quickstart samples GRPO at 0.7)
    cfg = load_config(QuickstartConfig, None, ["rollout.temperature=1"])
    assert isinstance(cfg.rollout.temperature, float)
    with pytest.raises(ConfigError, match="key=value"):
        load_config(QuickstartConfig, None, ["seed"])
    with pytest.raises(ConfigError, match="unknown key 'nope'"):
        load_config(QuickstartConfig, None, ["nope=1"])


def test_validation_and_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="max_turns must be positive"):
        load_config(QuickstartConfig, None, ["rollout.max_turns=0"])
    with pytest.raises(ConfigError, match="shards vLLM's engine: set rollout.backend=vllm"):
        load_config(QuickstartConfig, None, ["rollout.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        load_config(QuickstartConfig, None, ["rollout.backend=vllm", "rollout.tensor_parallel_size=0"])
    with pytest.raises(ConfigError, match="vocab_size"):
        load_config(TinyModelConfig, None, ["vocab_size=10"])
    with pytest.raises(
        ConfigError, match=r"warmup_phases must be among grounding, perception, reading; got \['percepton'\]"
    ):
        load_config(QuickstartConfig, None, ["warmup_phases=[grounding, percepton]"])
    with pytest.raises(ConfigError, match=r"warmup_epochs lists 2 numbers for 3 warmup_phases"):
        load_config(QuickstartConfig, None, ["warmup_phases=[grounding, perception, reading]"])
    with pytest.raises(ConfigError, match="warmup_epochs >= 0"):
        load_config(QuickstartConfig, None, ["warmup_epochs=[4, -1]"])
    from quickstart.data import warmup_runs  # one number for all phases, or one each; 0 skips a phase

    every = load_config(QuickstartConfig, None, ["warmup_epochs=3"])
    assert warmup_runs(every) == [
        ("sft-warmup-perception", "perception", 3.0),
        ("sft-warmup-grounding", "grounding", 3.0),
    ]
    each = load_config(
        QuickstartConfig, None, ["warmup_phases=[perception, grounding, perception]", "warmup_epochs=[2, 0, 5]"]
    )
    assert warmup_runs(each) == [
        ("sft-warmup-perception-1", "perception", 2.0),
        ("sft-warmup-perception-3", "perception", 5.0),
    ]
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(QuickstartConfig, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(QuickstartConfig, _write(tmp_path, "seed: [1,\n"))
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(QuickstartConfig, _write(tmp_path, "- 1\n- 2\n"))


def test_the_call_and_frame_budgets_are_checked_and_reach_the_rollout_limits():
    from quickstart.run import _limits

    budgets = ["rollout.max_tool_calls=3", "rollout.frame_budget=[2, 6]", "rollout.max_images=8"]
    cfg = load_config(QuickstartConfig, None, [*budgets, "seed=5"])
    limits = _limits(cfg)
    assert (limits.max_tool_calls, list(limits.frame_budget), limits.seed) == (3, [2, 6], 5)
    assert _limits(load_config(QuickstartConfig, None, [])).max_tool_calls is None  # null: only the profile's cap
    with pytest.raises(ConfigError, match="max_tool_calls must be positive"):
        load_config(QuickstartConfig, None, ["rollout.max_tool_calls=0"])
    for bad in ("[6, 2]", "[0, 3]", "[4]"):
        with pytest.raises(ConfigError, match=r"frame_budget must be \[lo, hi\]"):
            load_config(QuickstartConfig, None, [f"rollout.frame_budget={bad}"])
    with pytest.raises(ConfigError, match="leaves no room under max_images"):
        load_config(QuickstartConfig, None, ["rollout.frame_budget=[2, 8]", "rollout.max_images=8"])
    with pytest.raises(ConfigError, match="frame_budget does not apply to pixel-reasoner"):
        load_config(QuickstartConfig, None, [*budgets, "rollout.agent=pixel-reasoner"])
    assert load_config(QuickstartConfig, None, ["rollout.tool_workers=32"]).rollout.tool_workers == 32
    with pytest.raises(ConfigError, match="tool_workers must be positive"):
        load_config(QuickstartConfig, None, ["rollout.tool_workers=0"])


def test_defaults_are_not_shared_between_instances():
    a, b = load_config(QuickstartConfig), load_config(QuickstartConfig)
    a.warmup_phases.append("reading")
    assert b.warmup_phases == ["perception", "grounding"]


def test_exponent_without_a_dot_is_a_number_not_a_string():
    # YAML 1.1 (PyYAML) reads `lr: 2e-5` as the string "2e-5"; a float field takes it as the number.
    from vagent.config import SFTConfig

    assert load_config(SFTConfig, None, ["model.path=m", "data.train=t.jsonl", "optim.lr=2e-5"]).optim.lr == 2e-5
    with pytest.raises(ConfigError, match="optim.lr"):
        load_config(SFTConfig, None, ["optim.lr=fast"])


def test_deepspeed_configs_fill_their_auto_values_and_every_reference_exists():
    import json

    from vagent.config import SFTConfig
    from vagent.training.backend import load_deepspeed_config

    jsons = sorted((CONFIG_DIR / "deepspeed").glob("*.json"))
    assert {p.stem for p in jsons} >= {"zero2", "zero3"}
    for path in jsons:
        cfg = load_deepspeed_config(path, micro_batch_size=2, grad_accum=4, world_size=8, max_grad_norm=1.0, bf16=True)
        assert cfg["train_batch_size"] == 64 and cfg["bf16"]["enabled"] is True
        assert "auto" not in json.dumps(cfg)
    for path in sorted((CONFIG_DIR / "sft").glob("*.yaml")):
        ds = load_config(SFTConfig, path).train.deepspeed
        assert ds is None or (CONFIG_DIR.parent / ds).is_file(), f"{path} names a missing {ds}"


def test_deepspeed_config_that_contradicts_the_recipe_is_an_error(tmp_path):
    from vagent.training.backend import load_deepspeed_config

    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 4}')
    with pytest.raises(ValueError, match="contradicts"):
        load_deepspeed_config(path, micro_batch_size=2, grad_accum=1, world_size=1, max_grad_norm=1.0, bf16=False)


def test_a_partly_given_section_keeps_the_parents_defaults_for_the_rest():
    # QuickstartConfig's model section defaults to a smaller pixel budget than ModelConfig's own defaults
    cfg = load_config(QuickstartConfig, None, ["model.device=cpu", "tiny.seed=3"])
    default = load_config(QuickstartConfig)
    assert cfg.model.max_pixels == default.model.max_pixels and cfg.tiny.size == default.tiny.size
    assert cfg.model.device == "cpu" and cfg.tiny.seed == 3


def test_the_reward_weights_given_are_the_whole_set_and_everything_else_merges_into_the_defaults(tmp_path):
    """``rewards.weights`` is a set: given as a mapping (in a file or as an override), it is every reward component,
    never the defaults plus it (a judge-only or Tool-Star-only run must not also score crop IoU); one entry set with
    a dotted override adds to the weights in force, the file's or the defaults'. Everything else merges key by key:
    a sub-section given in part (``grpo.self_critic``), and ``rewards.options`` (one reward's options given in a
    file keep the others' defaults: ``overlong``'s window stays the config's, not the function's)."""
    from vagent.config import GRPOConfig

    defaults = GRPOConfig()
    config = tmp_path / "grpo.yaml"
    config.write_text("model: {path: m}\ndata: {train: rows.jsonl}\n"
                      "rewards:\n  weights: {judgment: 1.0}\n  options: {call_budget: {budget: 2}}\n"
                      "grpo:\n  self_critic: {enabled: true}\n")  # fmt: skip
    cfg = load_config(GRPOConfig, config)
    assert cfg.rewards.weights == {"judgment": 1.0}
    assert cfg.rewards.options == {**defaults.rewards.options, "call_budget": {"budget": 2}}
    assert cfg.grpo.self_critic.enabled and cfg.grpo.self_critic.beta == defaults.grpo.self_critic.beta
    cfg = load_config(GRPOConfig, config, ["rewards.weights.tool_star=0.5"])
    assert cfg.rewards.weights == {"judgment": 1.0, "tool_star": 0.5}
    cfg = load_config(GRPOConfig, None, ["model.path=m", "data.train=r", "rewards.weights.tool_star=0.5",
                                         "rewards.options.overlong.max_tokens=100"])  # fmt: skip
    assert cfg.rewards.weights == {**defaults.rewards.weights, "tool_star": 0.5}
    assert cfg.rewards.options["overlong"] == {**defaults.rewards.options["overlong"], "max_tokens": 100}
    cfg = load_config(GRPOConfig, config, ["rewards.weights={tool_star: 1.0}"])
    assert cfg.rewards.weights == {"tool_star": 1.0}


def test_the_shipped_quickstart_yaml_is_the_built_in_default():
    """`vagent quickstart` without --config runs the configuration `make run` runs and the docs measured."""
    shipped = load_config(QuickstartConfig, CONFIG_DIR / "quickstart" / "tiny_cpu.yaml", ["model.device=null"])
    assert shipped == load_config(QuickstartConfig)
    video = CONFIG_DIR / "quickstart" / "video_cpu.yaml"
    assert config_class(str(video), []) is VideoConfig and config_class(None, ["task=video"]) is VideoConfig
    assert load_config(VideoConfig, video, ["model.device=null"]) == load_config(VideoConfig)
    tools = CONFIG_DIR / "quickstart" / "tools_cpu.yaml"
    assert config_class(str(tools), []) is ToolsConfig
    assert load_config(ToolsConfig, tools, ["model.device=null"]) == load_config(ToolsConfig)


def test_the_video_proofs_first_view_is_its_clips():
    with pytest.raises(ConfigError, match=r"rollout.frame_budget must be \[6, 6\]"):
        load_config(VideoConfig, None, ["rollout.frame_budget=[4, 6]"])
    with pytest.raises(ConfigError, match="task"):
        load_config(QuickstartConfig, None, ["task=video"])  # the crop proof's class refuses another task
