"""Prefix K/V kept across requests (suffix K/V is never stored)."""

from .prefix_kv import PrefixKV

__all__ = ["PrefixKV"]
