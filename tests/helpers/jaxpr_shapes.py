"""Every intermediate's shape in a jaxpr: what the "never builds tokens x vocab" tests read."""


def shapes(jaxpr):
    """Every intermediate's shape in a jaxpr, nested jaxprs (loops, maps, jits) included."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield tuple(getattr(v.aval, "shape", ()))
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from shapes(inner)
