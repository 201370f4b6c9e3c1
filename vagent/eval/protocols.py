"""Published agents' evaluation protocols as named presets (``vagent eval --protocol NAME``).

A score is only comparable under the protocol that made it: k samples or one, temperature, turn, image, token and
pixel budgets, how the answer is read, whether a judge grades it. Each preset sets those as the agent's own
evaluation code does (``SOURCES`` cites the file for every value); any flag given on the command line overrides
its field, and the run's card (``protocol.json``, ``vagent.eval.card``) names each override. The judge's endpoint
stays the user's (``--judge URL``): a preset only says whether the protocol uses one and how it grades.

``resolve`` turns the parsed flags (None = not given) into the values a run uses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["BUILTIN", "FIELDS", "PROTOCOLS", "Protocol", "resolve"]


@dataclass(frozen=True)
class Protocol:
    """One agent's evaluation protocol.

    Attributes:
        name: The ``--protocol`` name.
        agent: The agent profile (``vagent.agents.PROFILES``): prompt, call syntax, observations, answer tag.
        samples: Samples per record (k of avg@k).
        temperature: 0 = greedy.
        top_p: Nucleus mass.
        max_turns: Assistant turns per episode (None: the profile's own).
        max_images: Images per episode, prompt included (None: the profile's own).
        max_new_tokens: Tokens per turn.
        max_total_tokens: Tokens per episode (the context the agent ran with).
        max_tool_calls: Tool calls per episode (None: the profile's own cap).
        max_pixels: Pixel budget of the images shown (None: the checkpoint's processor).
        min_pixels: Smallest image size (None: the checkpoint's processor).
        extract: How an option is read off a reply (``vagent.eval.extract.EXTRACTORS``).
        parse_fallback: ``none`` or ``random`` (a reply no rule reads scores a random option).
        judge: Whether the protocol's reported scores come from a model judge (pass ``--judge URL``).
        judge_mode: How the judge grades: ``correct`` (1/0) or ``score`` (0-10).
        option_order: ``as-listed``: the options in the order the benchmark file lists them, which for V*'s
            per-image JSONs puts the right one first (DeepEyes' script does this); None: the loader's own order.
        benchmarks: What the agent's paper reports under this protocol.
        notes: What vagent does not reproduce, or reproduces differently.
    """

    name: str
    agent: str
    samples: int
    temperature: float
    top_p: float
    max_turns: int | None
    max_images: int | None
    max_new_tokens: int
    max_total_tokens: int
    max_tool_calls: int | None
    max_pixels: int | None
    min_pixels: int | None
    extract: str
    parse_fallback: str
    judge: bool
    judge_mode: str
    option_order: str | None
    benchmarks: tuple[str, ...]
    notes: str = ""


# The flags a protocol sets (each a Protocol field and a `vagent eval` flag of the same name) and their values
# when neither a protocol nor the command line gives one (None: the agent profile's or the checkpoint's own).
BUILTIN: dict[str, Any] = {
    "agent": "vagent",
    "samples": 1,
    "temperature": 0.0,
    "top_p": 1.0,
    "max_turns": None,
    "max_images": None,
    "max_new_tokens": 512,
    "max_total_tokens": 8192,
    "max_tool_calls": None,
    "max_pixels": None,
    "min_pixels": None,
    "extract": "vagent",
    "parse_fallback": "none",
    "judge_mode": "correct",
    "option_order": None,
}
FIELDS = tuple(BUILTIN)

PROTOCOLS: dict[str, Protocol] = {}  # filled below, one entry per agent


def resolve(given: dict[str, Any], protocol: str | None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The values a run uses for ``FIELDS``, and the protocol's fields a flag changed.

    Args:
        given: The parsed flags, None where not given.
        protocol: A ``PROTOCOLS`` name, or None (flags and built-in values only).

    Returns:
        ``(values, overrides)``: ``values[field]`` is the flag's value if given, else the protocol's, else
        ``BUILTIN``'s; ``overrides[field] = {"preset": ..., "used": ...}`` for each flag that changed the protocol.

    >>> values, overrides = resolve({"samples": 8}, "mini-o3")
    >>> values["samples"], values["temperature"], overrides
    (8, 1.0, {'samples': {'preset': 32, 'used': 8}})
    """
    preset = dataclasses.asdict(PROTOCOLS[protocol]) if protocol else {}
    values, overrides = {}, {}
    for field in FIELDS:
        flag = given.get(field)
        base = preset[field] if protocol else BUILTIN[field]
        values[field] = flag if flag is not None else base
        if protocol and flag is not None and flag != base:
            overrides[field] = {"preset": base, "used": flag}
    return values, overrides


def _add(protocol: Protocol) -> None:
    PROTOCOLS[protocol.name] = protocol


# Each value as the agent's own evaluation code sets it; tests/test_eval_protocols.py cites the file for each.
_add(Protocol(
    name="deepeyes", agent="deepeyes", samples=1, temperature=0.0, top_p=1.0, max_turns=11, max_images=None,
    max_new_tokens=10240, max_total_tokens=32768, max_tool_calls=None, max_pixels=16384 * 28 * 28, min_pixels=4 * 28 * 28,
    extract="vagent", parse_fallback="none", judge=True, judge_mode="correct", option_order="as-listed",
    benchmarks=("vstar", "hr-bench"),
    notes="V*'s options in the per-image JSON order, the right one always A (eval_vstar.py at a7a337a; a later "
          "version shuffles them unseeded): --option-order as-listed, which the preset sets. HR-Bench used 8192 "
          "tokens a turn (--max-new-tokens 8192). Not reproduced: the eval script runs a turn's first call (the "
          "profile, as DeepEyes' training, the last) and re-sends a turn with neither call nor answer; its judge "
          "(Qwen2.5-72B) used a prompt with seven worked examples, vagent's judge its own prompt.",
))  # fmt: skip
_add(Protocol(
    name="mini-o3", agent="mini-o3", samples=32, temperature=1.0, top_p=1.0, max_turns=12, max_images=12,
    max_new_tokens=8192, max_total_tokens=32768 - 2000, max_tool_calls=None, max_pixels=2_000_000, min_pixels=40_000,
    extract="strict", parse_fallback="none", judge=True, judge_mode="correct", option_order=None,
    benchmarks=("visualprobe", "vstar", "hr-bench", "mme-realworld"),
    notes="avg@32 at temperature 1.0. Mini-o3 resizes the prompt image to 2,000,000 pixels without rounding to "
          "multiples of 28; vagent's processor rounds. Its judge is GPT-4o; a judgment that failed five times counts wrong there, while vagent "
          "leaves it out of judged_accuracy and counts it in judge_failures.",
))  # fmt: skip
_add(Protocol(
    name="pixel-reasoner", agent="pixel-reasoner", samples=1, temperature=0.0, top_p=1.0, max_turns=5,
    max_images=16, max_new_tokens=2048, max_total_tokens=12 * 1024 - 200, max_tool_calls=4,
    max_pixels=5120 * 28 * 28, min_pixels=512 * 28 * 28, extract="vagent", parse_fallback="none", judge=False,
    judge_mode="correct", option_order=None, benchmarks=("vstar",),
    notes="Greedy at evaluation whatever the script passes; a fifth call ends the episode. Scored by rules on the "
          "last \\boxed{} (math_verify there, vagent's option match here); the prompt image is resized twice "
          "(6,272,000 then the engine's 4,014,080 pixels), vagent once.",
))  # fmt: skip
_add(Protocol(
    name="chain-of-focus", agent="chain-of-focus", samples=1, temperature=0.0, top_p=1.0, max_turns=6, max_images=6,
    max_new_tokens=512, max_total_tokens=32768, max_tool_calls=None, max_pixels=3840 * 3840, min_pixels=112 * 112,
    extract="strict", parse_fallback="none", judge=True, judge_mode="correct", option_order=None,
    benchmarks=("vstar",),
    notes="A sixth turn that still calls a tool ends without an answer (scored wrong). Its judge is "
          "Qwen2.5-VL-72B with DeepEyes' worked examples.",
))  # fmt: skip
_add(Protocol(
    name="thyme", agent="thyme", samples=1, temperature=0.01, top_p=0.001, max_turns=5, max_images=None,
    max_new_tokens=2048, max_total_tokens=32768, max_tool_calls=None, max_pixels=None, min_pixels=None,
    extract="vlmevalkit", parse_fallback="none", judge=True, judge_mode="correct", option_order=None,
    benchmarks=("vstar", "hr-bench", "mme-realworld"),
    notes="VLMEvalKit: can_infer, then a judge (gpt-3.5-turbo-0125), then a random option after three failed "
          "judgments. Not reproduced: top_k 1, and Thyme's five whole-episode retries at temperature 1.0 ending "
          "in a no-tool prompt.",
))  # fmt: skip
_add(Protocol(
    name="longvt", agent="longvt", samples=1, temperature=0.0, top_p=1.0, max_turns=32, max_images=None,
    max_new_tokens=49152, max_total_tokens=65536, max_tool_calls=None, max_pixels=None, min_pixels=None,
    extract="lmms-eval", parse_fallback="none", judge=True, judge_mode="correct", option_order=None,
    benchmarks=("video-mme-sub", "longvideobench", "temporal-grounding"),
    notes="lmms-eval's loop has no turn cap (32 here) and the server's context is the episode's. The prompt video "
          "is 1 fps up to 768 frames of 50,176 pixels in the benchmark script; the longvt profile follows the "
          "demo's 512 frames. Its judge is Qwen3-235B-A22B (Qwen2.5-72B judged the RL rewards). longvt and "
          "lvbench tasks used 4096 tokens a turn (--max-new-tokens 4096).",
))  # fmt: skip
_add(Protocol(
    name="deepeyesv2", agent="deepeyesv2", samples=1, temperature=0.0, top_p=1.0, max_turns=11, max_images=None,
    max_new_tokens=20480, max_total_tokens=32768, max_tool_calls=None, max_pixels=16384 * 28 * 28,
    min_pixels=4 * 28 * 28, extract="vlmevalkit", parse_fallback="none", judge=True, judge_mode="correct",
    option_order=None, benchmarks=("vstar", "hr-bench", "mme-realworld"),
    notes="VLMEvalKit's agent mode: can_infer, then an OpenAI-compatible judge, then a random option after three "
          "failed judgments. Its evaluation prompt offers code only, without the <think> prefill of the demo the "
          "deepeyesv2 profile follows; a turn with neither code nor answer is sent again there.",
))  # fmt: skip
