"""How an answer is read off a model's reply, as each evaluation harness reads it.

The same reply can score differently under two harnesses: VLMEvalKit's option-letter rule, lmms-eval's and a strict
``<answer>`` tag disagree on replies such as "B or C", "The answer is (B)" without a tag, or an option's text with
no letter. ``--extract`` picks the rule; a reply no rule can read is a parse failure, counted and shown, never
silently scored as a guess.

Rules (``EXTRACTORS``):

* ``vagent``: the agent profile's answer (``<answer>``, ``\\boxed``, ... as the profile reads it), matched to an
  option by letter or text (``vagent.rewards.answer.choice_match``).
* ``strict``: only the profile's answer tag; a reply without one is a parse failure.
* ``vlmevalkit``: VLMEvalKit's ``can_infer`` over the answer (or, without one, the whole last reply).
* ``lmms-eval``: lmms-eval's ranked multiple-choice formats over the same text.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["EXTRACTORS", "extract_choice", "extract_text"]

EXTRACTORS = ("vagent", "strict", "vlmevalkit", "lmms-eval")


def extract_choice(reply: str, answer: str | None, choices: Sequence[str], rule: str = "vagent") -> str | None:
    """The option letter ("A", "B", ...) a sample picked under ``rule``, or None when the rule reads none.

    Args:
        reply: The last assistant turn's whole text (``Trajectory.last_reply``).
        answer: What the agent profile extracted as the answer (``Trajectory.answer``), or None.
        choices: The options' texts, in letter order (no "A." prefixes).
        rule: One of ``EXTRACTORS``.
    """
    from vagent.rewards.answer import choice_match

    if rule not in EXTRACTORS:
        raise ValueError(f"unknown extraction rule {rule!r}; choose from {', '.join(EXTRACTORS)}")
    if answer is None:
        return None
    for i in range(len(choices)):
        letter = chr(ord("A") + i)
        if choice_match(answer, letter, choices):
            return letter
    return None


def extract_text(reply: str, answer: str | None, rule: str = "vagent") -> str | None:
    """The answer text of an open-ended sample under ``rule`` (None: a parse failure): the profile's answer for
    ``vagent`` and ``strict``; for the harness rules the answer, or without one the whole last reply."""
    if rule not in EXTRACTORS:
        raise ValueError(f"unknown extraction rule {rule!r}; choose from {', '.join(EXTRACTORS)}")
    if answer is not None or rule in ("vagent", "strict"):
        return answer
    return reply.strip() or None
