"""hldstudy: hidden-layer vs logit distillation, compute-matched (docs/README.md)."""

from hldstudy import platforms as _platforms

# Before any module of the package imports JAX: the platform it starts, its plugins quiet.
_platforms.settle()
