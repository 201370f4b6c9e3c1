"""Data: the canonical row schema and the one encoder of conversations into model tensors.

The encoder needs torch and the processor stack; it is imported on first use so that code which only reads
or writes rows (the CLI's argument parsing, converters, benchmark loaders) starts without them."""

from typing import TYPE_CHECKING

from vagent.data.judgment import Judgment
from vagent.data.rows import ANSWER_TYPES, AnswerType, Evidence, Row, RowError, load_rows, write_rows

if TYPE_CHECKING:
    from vagent.data.encode import Encoded, encode_messages, encode_segment, template_dicts, template_suffix

_ENCODE = ("Encoded", "encode_messages", "encode_segment", "template_dicts", "template_suffix")

__all__ = [
    "ANSWER_TYPES",
    "AnswerType",
    "Encoded",
    "Evidence",
    "Judgment",
    "Row",
    "RowError",
    "encode_messages",
    "encode_segment",
    "load_rows",
    "template_dicts",
    "template_suffix",
    "write_rows",
]


def __getattr__(name: str):
    if name in _ENCODE:
        from vagent.data import encode

        return getattr(encode, name)
    raise AttributeError(f"module 'vagent.data' has no attribute {name!r}")
