"""How an answer is read off a model's reply, as each evaluation harness reads it.

The same reply can score differently under two harnesses: VLMEvalKit's option-letter rule, lmms-eval's and a strict
``<answer>`` tag disagree on replies such as "B or C", "The answer is (B)" without a tag, or an option's text with
no letter. ``--extract`` picks the rule; a reply no rule can read is a parse failure, counted and shown, never
silently scored as a guess (lmms-eval's LongVideoBench guess is there only when a caller passes ``fallback``).

Rules (``EXTRACTORS``), each over ``answer`` (what the agent profile read: ``<answer>``, ``\\boxed``, ...) and, for the
harness rules, the whole last reply when the profile read none:

* ``vagent``: the profile's answer matched to an option by letter or text (``vagent.rewards.answer.choice_match``).
* ``strict``: only the profile's answer, and only when it is one option letter ("B", "(B)", "B.", "B) blue truck")
  or exactly one option's text; anything else, or no answer, is a parse failure.
* ``vlmevalkit``: VLMEvalKit's ``can_infer``: a lone option letter among the last tokens, "answer is X", then an
  option's text contained once; its refusal answer ('Z') is a parse failure here, as is everything it cannot infer.
* ``lmms-eval``: lmms-eval's ranked multiple-choice formats (``extract_mcq_answer``, the rule of its Video-MME task)
  after its default ``<think>``/``<analysis>`` stripping; with ``fallback``, its LongVideoBench rule instead: the
  first capital A-E, or a random option when there is none.

The harness rules are reimplemented from the harnesses' code at the snapshots read (VLMEvalKit e8e78f05, 2026-08-18;
lmms-eval 75571cfe, 2026-08-06); each function names the file it follows. Both harnesses change these rules now and
then (VLMEvalKit added "answer is X" in #1552; lmms-eval's Video-MME read the first capital A-D before #1274).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from vagent.rewards.answer import choice_match, normalize_answer, parse_span

__all__ = ["EXTRACTORS", "extract_choice", "extract_span", "extract_text"]

EXTRACTORS = ("vagent", "strict", "vlmevalkit", "lmms-eval")


def extract_choice(reply: str, answer: str | None, choices: Sequence[str], rule: str = "vagent", *,
                   task: str | None = None, fallback: random.Random | None = None) -> str | None:  # fmt: skip
    """The option letter ("A", "B", ...) a sample picked under ``rule``, or None when the rule reads none.

    Args:
        reply: The last assistant turn's whole text (``Trajectory.last_reply``).
        answer: What the agent profile extracted as the answer (``Trajectory.answer``), or None.
        choices: The options' texts, in letter order (no "A." prefixes).
        rule: One of ``EXTRACTORS``.
        task: The benchmark (``Row.source``): under ``lmms-eval``, ``longvideobench`` reads the reply with that
            task's own parser (``parse_multi_choice_response``) instead of the ranked formats Video-MME's uses.
        fallback: Only when the user asks for it (``--parse-fallback random``): a reply the rule reads no option
            from picks a random option from this generator, as lmms-eval's LongVideoBench task does. A letter that
            is not an option (an "E" of four options) is still None: lmms-eval scores it wrong.

    >>> extract_choice("B or C", "B or C", ["red", "blue", "green"], "vlmevalkit") is None  # two letters: no answer
    True
    >>> extract_choice("The answer is (B).", None, ["red", "blue"], "lmms-eval")
    'B'
    """
    if rule not in EXTRACTORS:
        raise ValueError(f"unknown extraction rule {rule!r}; choose from {', '.join(EXTRACTORS)}")
    letters = [chr(ord("A") + i) for i in range(min(len(choices), 26))]
    if rule == "lmms-eval" and (task or "").startswith("longvideobench"):  # -nosub too: the same task parser
        text = _strip_reasoning(reply if answer is None else answer)
        return _lmms_longvideobench(text, letters, fallback)
    picked = _read_choice(reply, answer, choices, rule, letters)
    if picked is None and fallback is not None and letters:
        return fallback.choice(letters)
    return picked


def _read_choice(reply: str, answer: str | None, choices: Sequence[str], rule: str,
                 letters: Sequence[str]) -> str | None:  # fmt: skip
    if rule == "vagent":
        if answer is None:
            return None
        return next((letter for letter in letters if choice_match(answer, letter, choices)), None)
    if rule == "strict":
        return None if answer is None else _strict(answer, choices, letters)
    text = reply if answer is None else answer
    if rule == "vlmevalkit":
        return _vlmevalkit(text, choices, letters)
    return _lmms_mcq(_strip_reasoning(text), letters)


def extract_text(reply: str, answer: str | None, rule: str = "vagent") -> str | None:
    """The answer text of an open-ended sample under ``rule`` (None: a parse failure): the profile's answer for
    ``vagent`` and ``strict``; for the harness rules the answer, or without one the whole last reply, which
    lmms-eval reads with its ``<think>``/``<analysis>`` blocks stripped (as it strips every task's output by default)
    and VLMEvalKit reads whole.

    >>> extract_text("<think>hmm</think> Paris", None, "lmms-eval"), extract_text("Paris", None, "strict")
    ('Paris', None)
    """
    if rule not in EXTRACTORS:
        raise ValueError(f"unknown extraction rule {rule!r}; choose from {', '.join(EXTRACTORS)}")
    if answer is not None or rule in ("vagent", "strict"):
        return answer
    text = _strip_reasoning(reply) if rule == "lmms-eval" else reply.strip()
    return text or None


# --- strict -----------------------------------------------------------------------------------------------------

# "(B)", "(B).", "(B) blue truck"; "B", "B.", "B)", "B:", "B. blue truck". Capital letters only: a lowercase "a" or
# "b" is a word as often as a letter, and "A blue truck" (no punctuation after the letter) is read as text.
_STRICT_LETTER = re.compile(r"\(([A-Z])\)[.:]?(?:\s+(?P<rest>.*))?|([A-Z])(?:[.:)](?:\s*(?P<rest2>.*))?)?", re.S)


def _strict(answer: str, choices: Sequence[str], letters: Sequence[str]) -> str | None:
    """One option letter, optionally followed by exactly that option's text, or exactly one option's text (both
    compared after ``normalize_answer``: case, punctuation, articles). A letter form wins over a text form (an
    option whose text is "C" is picked by the letter C); "B. red car" where B is not "red car", "B or C",
    "The answer is B", a letter past the last option and an empty answer are all parse failures."""
    text = answer.strip()
    match = _STRICT_LETTER.fullmatch(text)
    if match:
        letter = match.group(1) or match.group(3)
        rest = match.group("rest") or match.group("rest2") or ""
        if letter not in letters:
            return None
        index = ord(letter) - ord("A")
        return letter if not rest or normalize_answer(rest) == normalize_answer(choices[index]) else None
    wanted = normalize_answer(text)
    hits = [letter for i, letter in enumerate(letters) if wanted and normalize_answer(choices[i]) == wanted]
    return hits[0] if len(hits) == 1 else None


# --- VLMEvalKit ---------------------------------------------------------------------------------------------------

_VLMEVAL_REFUSALS = (
    "Sorry, I can't help with images of people yet.",
    "I can't process this file.",
    "I'm sorry, but without the image provided",
    "Cannot determine the answer",
)
_VLMEVAL_SEPARATORS = str.maketrans(dict.fromkeys(".()[],:;!*#{}", " "))
_VLMEVAL_ANSWER_IS = re.compile(r"(?:correct\s+)?answer\s+is\s+\**([ABCD])\**", re.I)


def _vlmevalkit(text: str, choices: Sequence[str], letters: Sequence[str]) -> str | None:
    """VLMEvalKit's ``can_infer`` (open-compass/VLMEvalKit, vlmeval/utils/matching_util.py), as
    vlmeval/dataset/utils/multiple_choice.py ``extract_answer_from_item`` calls it on the prediction: the option rule,
    then the text rule. Where both fail VLMEvalKit asks an LLM judge, or without one (``exact_matching``) marks the
    sample 'Z'; its refusal answers are 'Z' too. Every 'Z' is None here (no judge, no guess)."""
    option = _vlmeval_option(text, letters)
    if option == "Z":
        return None
    return option or _vlmeval_text(text, choices, letters)


def _vlmeval_option(text: str, letters: Sequence[str]) -> str | None:
    """``can_infer_option``: after turning ``.()[],:;!*#{}`` into spaces and splitting on whitespace, exactly one
    distinct option letter among the tokens (case-sensitive), first seen among the last four tokens; else, with no
    letter at all, a "Z" token means 'Z'. Failing those, "answer is X" / "correct answer is **X**" anywhere,
    case-insensitive, X one of A-D and an option (so "The answer is based on ..." reads B, as VLMEvalKit does).
    VLMEvalKit's "A might be a quantifier" rejection runs only with its VERBOSE environment flag, off by default."""
    if "Failed to obtain answer via API" in text:
        return None
    if any(refusal in text for refusal in _VLMEVAL_REFUSALS):
        return "Z"
    tokens = text.translate(_VLMEVAL_SEPARATORS).split()
    present = [letter for letter in letters if letter in tokens]
    if len(present) == 1:
        if tokens.index(present[0]) > len(tokens) - 5:
            return present[0]
    elif not present and "Z" in tokens:
        return "Z"
    match = _VLMEVAL_ANSWER_IS.search(text)
    if match and match.group(1).upper() in letters:
        return match.group(1).upper()
    return None


def _vlmeval_text(text: str, choices: Sequence[str], letters: Sequence[str]) -> str | None:
    """``can_infer_text``: exactly one option's text (lowercased) is a substring of the lowercased reply, and the
    reply is at most twice as long as all option texts together (a long reasoning names several options)."""
    lowered = text.lower()
    if len(lowered) > 2 * sum(len(str(c)) for c in choices):
        return None
    hits = [letter for i, letter in enumerate(letters) if str(choices[i]).lower() in lowered]
    return hits[0] if len(hits) == 1 else None


# --- lmms-eval ----------------------------------------------------------------------------------------------------

_LMMS_REASONING_TAGS = (("<think>", "</think>"), ("<analysis>", "</analysis>"))  # its --reasoning_tags default

_LMMS_PHRASES = (
    *("the answer is", "answer is", "the correct answer is", "correct answer is", "the best answer is"),
    *("best answer is", "the correct option is", "correct option is", "the best option is", "best option is"),
    *("the choice is", "choice is", "the correct choice is", "correct choice is", "i choose", "i select"),
    *("i pick", "my answer is", "my choice is", "옵션", "정답은", "답은", "답:", "答案是", "答案为", "选", "答えは"),
)
# Letter formats by rank (higher wins; within a rank the later position wins): the reply's first character, its last,
# the first letter after an answer phrase, "(B)", "B.", "B:", "B)", "B ".
_LMMS_START, _LMMS_END, _LMMS_PHRASE, _LMMS_ANY = 10, 9, 7, 0
_LMMS_FORMATS = (("({})", 6), ("{}.", 5), ("{}:", 4), ("{})", 3), ("{} ", 2))

_LVB_PREFIXES = (
    *("The best answer is", "The correct answer is", "The answer is", "The answer", "The best option is"),
    *("The correct option is", "Best answer:", "Best option:"),
)


def _strip_reasoning(text: str) -> str:
    """lmms-eval's ``strip_reasoning_tags`` (EvolvingLMMs-Lab/lmms-eval, lmms_eval/api/reasoning.py) with its CLI's
    default tags, applied by lmms_eval/evaluator.py to every output before a task reads it: each closed block is cut;
    with a closing tag but no opening one (a prefilled ``<think>``), only the text after the last closing tag stays."""
    for start_tag, end_tag in _LMMS_REASONING_TAGS:
        while start_tag in text and end_tag in text:
            start = text.find(start_tag)
            end = text.find(end_tag, start)
            if end < 0:
                break
            text = text[:start] + text[end + len(end_tag) :]
        if end_tag in text and start_tag not in text:
            text = text.rsplit(end_tag, 1)[-1]
    return text.strip()


def _lmms_mcq(text: str, letters: Sequence[str]) -> str | None:
    """lmms-eval's ``extract_mcq_answer`` (EvolvingLMMs-Lab/lmms-eval, lmms_eval/tasks/_task_utils/mcq_extract.py),
    the rule lmms_eval/tasks/videomme/utils.py ``extract_characters_regex`` applies (Video-MME passes A-D; here the
    row's letters). Capital letters only. Every format proposes a candidate; the highest rank wins, the later position
    within a rank: so "B or C" reads B (the first character), and "The answer is B. Clearly ..." reads C (the C of
    "Clearly" is a later letter after the phrase). With no candidate at all, the last occurrence of any letter
    anywhere (the C of "Cannot"). None when no letter appears."""
    if not text.strip():
        return None
    text = text.strip()
    for char in ",.!?;:'\"":  # one after another, as lmms-eval strips them
        text = text.strip(char)
    text = f" {text} "
    candidates: list[tuple[int, int, str]] = []  # (rank, position, letter)
    for template, rank in _LMMS_FORMATS:
        for letter in letters:
            position = text.rfind(template.format(letter))
            if position >= 0:
                candidates.append((rank, position, letter))
    lowered = text.lower()
    for phrase in _LMMS_PHRASES:
        after = lowered.find(phrase)
        if after >= 0:
            after += len(phrase)
            # the first occurrence of each letter after the phrase, inside a word or not
            candidates += [(_LMMS_PHRASE, text.find(c, after), c) for c in letters if text.find(c, after) >= 0]
    core = text.strip()
    for letter in letters:
        if core.startswith(letter) and (len(core) == 1 or not core[1].isalpha()):
            candidates.append((_LMMS_START, 0, letter))
        if core.endswith(letter) and (len(core) == 1 or not core[-2].isalpha()):
            candidates.append((_LMMS_END, len(text) - 1, letter))
    if not candidates:
        candidates = [(_LMMS_ANY, text.rfind(c), c) for c in letters if c in text]
    # max keeps the first of equal (rank, position), as lmms-eval's stable reverse sort does
    return max(candidates, key=lambda c: (c[0], c[1]))[2] if candidates else None


def _lmms_longvideobench(text: str, letters: Sequence[str], rng: random.Random | None) -> str | None:
    """lmms-eval's LongVideoBench ``parse_multi_choice_response`` (EvolvingLMMs-Lab/lmms-eval,
    lmms_eval/tasks/longvideobench/utils.py): drop the answer prefixes ("The answer is", ..., case-sensitive), then
    the first capital A-E anywhere ("Because" reads B); with none, ``rng.choice`` of the options, as that task (after
    the LongVideoBench paper) guesses, or None without ``rng`` (a parse failure). Its "more than ten words and no A-E"
    branch guesses too, so it is the same case.
    """
    for prefix in _LVB_PREFIXES:
        text = text.replace(prefix, "")
    match = re.search(r"[ABCDE]", text)
    if match is None:
        return rng.choice(letters) if letters and rng is not None else None
    return match.group() if match.group() in letters else None


_TIME = re.compile(r"(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)|(\d+(?:\.\d+)?)")  # [h:]mm:ss[.f] or seconds


def extract_span(reply: str, answer: str | None, rule: str = "vagent") -> list[float] | None:
    """The ``[start, end]`` in seconds a temporal-grounding sample answered under ``rule``, or None.

    ``vagent`` and ``strict`` read the first two numbers of the profile's answer (``strict``: of the answer tag only,
    as the profile reads it); ``vlmevalkit`` the same of the answer or the whole reply. ``lmms-eval`` reads times as
    its Charades-STA scoring does: ``mm:ss`` and ``h:mm:ss`` as well as seconds, in the answer or the reply with its
    reasoning removed, and a reversed span is put in order.

    >>> extract_span("", "from 00:24 to 00:30.5", "lmms-eval"), extract_span("", "[30.4, 24.3]", "lmms-eval")
    ([24.0, 30.5], [24.3, 30.4])
    """
    if rule not in EXTRACTORS:
        raise ValueError(f"unknown extraction rule {rule!r}; choose from {', '.join(EXTRACTORS)}")
    text = answer if answer is not None or rule in ("vagent", "strict") else reply
    if text is None:
        return None
    if rule != "lmms-eval":
        return parse_span(text)
    times = []
    for hours, minutes, seconds, plain in _TIME.findall(_strip_reasoning(text)):
        times.append(float(plain) if plain else int(hours or 0) * 3600 + int(minutes) * 60 + float(seconds))
    return sorted(times[:2]) if len(times) >= 2 else None
