"""Token ids of chat text, tokenized turn by turn with each turn's ids remembered: a rollout's prompts repeat their
opening (the system prompt with its tool list, hundreds of tokens) for every task and every GRPO sample, and tool
turns repeat their frame; tokenizing it once rather than at every prompt is most of a prompt's encoding time.

Exact by construction and checked: Qwen's tokenizers split text at their added tokens before anything else, so the
ids of ``"...<|im_end|>\\n" + "<|im_start|>user..."`` are the ids of each part, joined. The first text that splits
into turns is also tokenized whole, and a tokenizer whose ids differ is tokenized whole from then on.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

__all__ = ["token_ids"]

TURN = "<|im_start|>"  # a chat turn's opening token: an added token in every Qwen-VL tokenizer
_KEPT = 1024  # turns remembered per tokenizer (least recently used first out)
_CACHES: weakref.WeakKeyDictionary[Any, _Turns] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # tool threads encode their outputs while the engine loop encodes prompts


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer(text)["input_ids"]``, from remembered turns where the text repeats them."""
    with _LOCK:
        turns = _CACHES.get(tokenizer)
        if turns is None:
            turns = _CACHES[tokenizer] = _Turns(tokenizer)
    return turns(text)


class _Turns:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: OrderedDict[str, list[int]] = OrderedDict()
        self.exact: bool | None = None  # turn by turn equals whole (None: not checked yet)
        self.lock = threading.Lock()

    def __call__(self, text: str) -> list[int]:
        first, *rest = text.split(TURN)
        if not rest or self.exact is False:
            return self._whole(text)
        pieces = ([first] if first else []) + [TURN + piece for piece in rest]
        ids = [i for piece in pieces for i in self._turn(piece)]
        if self.exact is None:
            whole = self._whole(text)
            self.exact = ids == whole
            return whole
        return ids

    def _turn(self, piece: str) -> list[int]:
        with self.lock:
            ids = self.ids.get(piece)
            if ids is not None:
                self.ids.move_to_end(piece)
                return ids
        ids = self._whole(piece)
        with self.lock:
            self.ids[piece] = ids
            if len(self.ids) > _KEPT:
                self.ids.popitem(last=False)
        return ids

    def _whole(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])
