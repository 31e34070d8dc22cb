"""Ahead-of-time compilation for the study's accelerators on a machine without them.

Design notes: `docs/aot.md`, under this file's name.
"""
