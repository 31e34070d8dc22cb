"""Distillation methods: declared in `methods` (no jax), computed by `base.Strategy`.

Import the registry from here (`from hldstudy.distill import methods`);
the strategy machinery from `hldstudy.distill.base` (it loads jax).
"""
