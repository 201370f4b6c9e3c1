"""One assistant turn for a conversation, through the same backend as the rollout engine.

``vagent generate`` and anything else that needs "sample a reply to these messages" use this, so there is
one sampling path (the ``GenerationBackend``: its KV cache, stop strings, suppressed vision tokens and
recorded log-probs) rather than a second one over HF ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass

from vagent.data.encode import encode_prompt, template_suffix
from vagent.media import load_image
from vagent.model import Policy
from vagent.rollout.backend import GenerationBackend, Sampling, TurnRequest
from vagent.rollout.hf_backend import HFBackend
from vagent.types import Message

__all__ = ["Generation", "generate"]


@dataclass
class Generation:
    """One sampled turn.

    Attributes:
        token_ids: Sampled ids, up to and including the stop (EOS or the last token of a stop string).
        logprobs: The policy's log-prob of each sampled id at temperature 1 (what a trainer recomputes). (n,)
        text: ``token_ids`` decoded, special tokens kept.
        stop: ``"eos"``, ``"stop_string"`` or ``"length"``.
        prompt_tokens: Length of the prompt the turn continued (with the assistant header).
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    stop: str
    prompt_tokens: int


def generate(
    policy: Policy,
    messages: list[Message],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_strings: tuple[str, ...] = (),
    n: int = 1,
    backend: GenerationBackend | None = None,
) -> list[Generation]:
    """Sample ``n`` assistant turns continuing ``messages`` (system/user messages; images as parts).

    Args:
        policy: The loaded policy.
        messages: The conversation so far; image parts hold a PIL image or a path.
        max_new_tokens: Budget of the turn.
        temperature: 0 = greedy.
        top_p: Nucleus mass when sampling.
        stop_strings: Extra stops (e.g. ``"</tool_call>"``) besides EOS.
        n: Samples (their identical prompt is prefilled once).
        backend: What generates (default: a new ``HFBackend``).

    Raises:
        vagent.media.MediaError: An image part cannot be loaded.
    """
    images = [load_image(p.image if p.image is not None else p.path) for m in messages for p in m.content
              if p.type == "image"]  # fmt: skip
    shown = [policy.model_view(image) for image in images]
    encoded = encode_prompt(policy.processor, messages, shown)
    header = policy.tokenizer.encode(template_suffix(policy.processor, [], add_generation_prompt=True))
    ids = encoded["input_ids"].tolist() + header
    pixels, grids = [], []
    if "pixel_values" in encoded:
        grids = list(encoded["image_grid_thw"].split(1))
        pixels = list(encoded["pixel_values"].split([int(g.prod()) for g in grids]))
    sampling = Sampling(max_new_tokens, temperature, top_p, tuple(stop_strings))
    backend = backend if backend is not None else HFBackend(policy)
    for key in range(n):
        backend.submit(TurnRequest(("generate", key), ids, pixels, grids, sampling, list(shown)))
    results = {}
    try:
        while backend.busy:
            results.update((r.key, r) for r in backend.step())
    finally:
        for key in range(n):
            backend.release(("generate", key))
    decode = policy.tokenizer.decode
    return [Generation(r.token_ids, r.logprobs, decode(r.token_ids), r.stop, len(ids))
            for r in (results[("generate", key)] for key in range(n))]  # fmt: skip
