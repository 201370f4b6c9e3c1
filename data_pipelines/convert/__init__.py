"""Converters from published dataset formats to canonical rows (each writes a rows JSONL)."""
