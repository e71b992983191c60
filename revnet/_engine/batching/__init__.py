"""Batching helpers: the batch axes of values and of primitive params."""
