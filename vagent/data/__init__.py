"""Data: the canonical row schema (and, next to it, the encoder of trajectories into tokens)."""

from vagent.data.rows import ANSWER_TYPES, AnswerType, Evidence, Row, RowError, load_rows, write_rows

__all__ = ["ANSWER_TYPES", "AnswerType", "Evidence", "Row", "RowError", "load_rows", "write_rows"]
