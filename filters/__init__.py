"""Filters between tokenization and the engine: lengths, supervised tokens, exact duplicates."""

from filters.length import FilterConfig, apply_filters, filter_prompt

__all__ = ["FilterConfig", "apply_filters", "filter_prompt"]
