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
    "ModelConfig",
    "QuickstartConfig",
    "RolloutConfig",
    "TinyModelConfig",
    "ToolboxConfig",
    "config_to_dict",
    "load_config",
    "option",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that does not match its schema; the message names the key and the source."""


def option(default: Any, help: str) -> Any:
    """A dataclass field with a default and a help string (shown by ``vagent ... --help-config``)."""
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        # mutable defaults: each instance gets its own deep copy (nested lists included)
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


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


def _build(cls: type[T], data: dict[str, Any], source: str, prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key '{prefix}{unknown[0]}' (valid keys{' in ' + prefix[:-1] if prefix else ''}: "
            f"{', '.join(names)})"
        )
    kwargs = {k: _coerce(v, hints[k], prefix + k, source) for k, v in data.items()}
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ValueError as e:
            raise ConfigError(f"{source}: {prefix[:-1] + ': ' if prefix else ''}{e}") from None
    return obj


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
        for override in overrides:
            _set_override(data, override)
    return _build(cls, data, source)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain dict (YAML/JSON ready) of a config."""
    return dataclasses.asdict(cfg)


# ---------------------------------------------------------------------------------------------------
# The configs. One dataclass per section; recipes take the top-level one.


@dataclass
class TinyModelConfig:
    family: Literal["qwen2_5_vl", "qwen2_vl", "qwen3_vl"] = option(
        "qwen2_5_vl", "Model family of the random tiny checkpoint."
    )
    size: Literal["nano", "tiny", "small"] = option("tiny", "Size preset (see vagent.tiny_model.PRESETS).")
    vocab_size: int = option(2048, "BPE vocabulary size of the tokenizer trained on the spot (before specials).")
    seed: int = option(0, "Seed for weights and tokenizer corpus.")

    def validate(self) -> None:
        if not 300 <= self.vocab_size <= 65536:
            raise ValueError(f"vocab_size must be in [300, 65536] (256 bytes + merges), got {self.vocab_size}")


@dataclass
class ModelConfig:
    path: str | None = option(None, "HF checkpoint dir. None builds (or reuses) a tiny random model under out_dir.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "Weights dtype; auto = bf16 on CUDA, fp32 on CPU."
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = option(
        "auto", "Attention kernel; auto = flash_attention_2 on CUDA when flash-attn is installed, else sdpa."
    )
    device: str | None = option(None, "torch device; None = cuda if available, else cpu.")
    min_pixels: int = option(
        28 * 28 * 4, "Tiny checkpoint's processor: smallest image, in pixels (a real checkpoint keeps its own)."
    )
    max_pixels: int = option(
        28 * 28 * 256,
        "Tiny checkpoint's processor: largest image the model sees, in pixels (a real checkpoint keeps its own).",
    )
    tiny: TinyModelConfig = option(TinyModelConfig(), "Tiny model to build when path is None.")

    def validate(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels} and {self.max_pixels}")


@dataclass
class RolloutConfig:
    max_turns: int = option(4, "Assistant turns per episode before it is cut (stop reason max_turns).")
    max_new_tokens: int = option(96, "Tokens the policy may sample in one turn.")
    max_total_tokens: int = option(4096, "Prompt + all turns; the episode stops at this length (max_tokens).")
    max_images: int = option(8, "Images per episode, prompt and tool outputs together (max_images).")
    temperature: float = option(1.0, "Sampling temperature; 0 = greedy.")
    top_p: float = option(1.0, "Nucleus sampling mass.")
    tools: list[str] = option(["crop"], "Tools offered to the policy.")

    def validate(self) -> None:
        for name in ("max_turns", "max_new_tokens", "max_total_tokens", "max_images"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


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
class QuickstartConfig:
    out_dir: str = option("runs/quickstart", "Where the tiny checkpoint, images and trajectory are written.")
    seed: int = option(0, "Seed for the generated image and sampling.")
    image_size: list[int] = option([896, 672], "Width and height of the generated task image (original pixels).")
    model: ModelConfig = option(ModelConfig(), "Policy to load.")
    rollout: RolloutConfig = option(RolloutConfig(), "Limits and sampling of the rollout.")
    toolbox: ToolboxConfig = option(ToolboxConfig(), "Services of the search and code tools.")

    def validate(self) -> None:
        if len(self.image_size) != 2 or min(self.image_size) < 64:
            raise ValueError(f"image_size must be [width, height] with both >= 64, got {self.image_size}")


# configs/<stage>/*.yaml is loaded with CONFIGS[stage]; a test loads every file that way.
CONFIGS: dict[str, type] = {
    "quickstart": QuickstartConfig,
    "tiny": TinyModelConfig,
}
