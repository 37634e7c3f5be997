"""A pytest plugin that removes every chain's sequencing: ``jax.lax.optimization_barrier`` becomes
the identity, so no bucket waits for another. The default test run must then fail.

    PYTHONPATH=tests python -m pytest -q -p mutation_no_barrier

It patches in ``pytest_configure``, after tests/conftest.py has set up the 8 CPU devices.
"""


def pytest_configure(config):
    import jax

    jax.lax.optimization_barrier = lambda operand: operand
