"""Data: the canonical row schema and the one encoder of conversations into model tensors."""

from vagent.data.encode import Encoded, encode_messages, encode_segment, template_dicts, template_suffix
from vagent.data.rows import ANSWER_TYPES, AnswerType, Evidence, Row, RowError, load_rows, write_rows

__all__ = [
    "ANSWER_TYPES",
    "AnswerType",
    "Encoded",
    "Evidence",
    "Row",
    "RowError",
    "encode_messages",
    "encode_segment",
    "load_rows",
    "template_dicts",
    "template_suffix",
    "write_rows",
]
