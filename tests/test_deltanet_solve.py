"""The DeltaNet chunk's unit-lower-triangular solve (`unit_lower_inverse`).

It replaced `lax.linalg.triangular_solve`, whose jaxlib 0.10 CPU kernel for batched
solves waits on an XLA pool thread for items queued to the same pool: a step running as
many independent solves as the pool has threads (two on a 2-core machine, as in a DeltaNet
student's backward) hung for good, with every thread asleep. The subprocess test runs
such a program (three independent chunked delta rules and their gradients) under a
deadline; with the LAPACK solve it never finished on a 2-core machine.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hldstudy.model.deltanet import unit_lower_inverse

ROOT = Path(__file__).resolve().parent.parent


def test_inverse_equals_the_triangular_solve():
    for c in (1, 5, 64):  # one block, a size padded to a power of two, the default chunk
        m = jnp.tril(0.3 * jax.random.normal(jax.random.PRNGKey(c), (2, 3, c, c)), -1) + \
            jnp.eye(c)
        inv = unit_lower_inverse(m)
        ref = jax.lax.linalg.triangular_solve(m, jnp.broadcast_to(jnp.eye(c), m.shape),
                                              left_side=True, lower=True, unit_diagonal=True)
        scale = float(jnp.max(jnp.abs(ref)))
        assert float(jnp.max(jnp.abs(inv - ref))) <= 1e-6 * scale, c
        np.testing.assert_allclose(np.asarray(inv @ m), np.broadcast_to(np.eye(c), m.shape),
                                   atol=1e-5)
        assert np.all(np.triu(np.asarray(inv), 1) == 0)  # exactly lower triangular


PROGRAM = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from hldstudy.model.deltanet import delta_rule_chunked, l2_normalize

    def loss(x):  # three independent layers: their solves may run at the same time
        out = 0.0
        for i in range(3):
            q, k = l2_normalize(x[i, 0]), l2_normalize(x[i, 1])
            g = -jax.nn.softplus(x[i, 2, ..., 0])
            beta = jax.nn.sigmoid(x[i, 3, ..., 0])
            out = out + jnp.sum(delta_rule_chunked(q, k, x[i, 4], g, beta, chunk=16) ** 2)
        return out

    step = jax.jit(jax.value_and_grad(loss))
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 4, 64, 4, 16))
    for _ in range(30):
        value, grad = step(x)
        jax.block_until_ready(grad)
    print("finished", float(value))
""")


def test_independent_chunked_delta_rules_do_not_deadlock(tmp_path):
    import os

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # one device: the pool the solves would share
    try:
        r = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                           env=env, timeout=240, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail("the chunked delta rule did not finish within 240 s (a deadlock)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "finished" in r.stdout
