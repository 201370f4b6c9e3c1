"""Stop strings matched on token ids, so a decode step decodes no text in the common case.

A turn ends when its text contains a stop string (``</tool_call>``, ``</answer>``). Decoding every row's
tail every step (the obvious check) costs a tokenizer call per row per step; here the check is integer
work except on the rare tokens that could complete a stop string:

1. Fast path: each stop string's own tokenization (``tokenizer.encode(stop)``) is precomputed; a row whose
   sampled ids end with one of these sequences stops without any decoding.
2. Fallback, for stops the model spells with other tokens (``"</"``, ``"answer"``, ``">"``; or ``">\\n"``,
   a token that runs past the stop): a stop string can first appear only at a token in whose text a stop
   can *end*: some prefix of the token's text is a suffix of the stop (the stop began in earlier tokens) or
   ends with the whole stop. Which tokens can is decided once per token id (its text decoded once, then
   cached); ``<tool_call>`` cannot end ``</tool_call>``, ``>`` and ``>\\n`` can. Only at those tokens
   the last few tokens are decoded: a stop of ``n`` UTF-8 bytes spans at most ``n`` tokens (each token
   is at least one byte), so ``n + 1`` tokens always cover it.

What it does not cover: a stop whose last character is not ASCII can be split across tokens by byte-level
BPE; tokens that decode to a partial character (U+FFFD) are then treated as possible triggers too, which
keeps it exact at the price of a decode on such tokens.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StopMatcher"]

_REPLACEMENT = "\ufffd"  # what a token holding part of a multi-byte character decodes to alone


class StopMatcher:
    """Finds stop strings at the end of a growing list of sampled token ids.

    Args:
        tokenizer: A transformers tokenizer (``encode``/``decode``).
        stops: The stop strings.

    Example: ``StopMatcher(tok, ("</answer>",)).matches(tok.encode("<answer>4</answer>"))`` is True.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.sequences = [tuple(tokenizer.encode(s, add_special_tokens=False)) for s in self.stops]
        self.non_ascii = any(not s.isascii() for s in self.stops)
        self.window = max((len(s.encode()) for s in self.stops), default=0) + 1
        self._triggers: dict[int, bool] = {}  # token id -> whether a stop can end in its text
        self.decodes = 0  # fallback decodes done (the fast path and non-trigger tokens cost none)

    def matches(self, tokens: list[int]) -> bool:
        """Whether the text of ``tokens`` contains a stop string ending in its last token."""
        if not self.stops or not tokens:
            return False
        for sequence in self.sequences:
            if sequence and tuple(tokens[-len(sequence) :]) == sequence:
                return True
        if not self._is_trigger(tokens[-1]):
            return False
        self.decodes += 1
        tail = self.tokenizer.decode(tokens[-self.window :])
        return any(s in tail for s in self.stops)

    def _is_trigger(self, token: int) -> bool:
        trigger = self._triggers.get(token)
        if trigger is None:
            text = self.tokenizer.decode([token])
            trigger = (self.non_ascii and _REPLACEMENT in text) or any(
                text[:end].endswith(stop) or stop.endswith(text[:end])
                for stop in self.stops
                for end in range(1, len(text) + 1)
                if text[end - 1] == stop[-1]
            )
            self._triggers[token] = trigger
        return trigger
