"""Builders and converters that write canonical rows (see ARCHITECTURE.md): synthetic tasks, converters."""
