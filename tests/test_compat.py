"""_compat: a jax internal that a check relies on raises when missing, never disables the check."""

import jax.numpy as jnp
import pytest
from jax._src import config as jax_config

from jax_drain import _compat


def test_missing_vma_flag_raises_instead_of_disabling_the_check(monkeypatch):
    monkeypatch.delattr(jax_config, "_check_vma")
    with pytest.raises(_compat.MissingJaxInternal, match=r"_check_vma.*jax_drain supports"):
        _compat.vma_checked()


def test_missing_axis_env_raises(monkeypatch):
    from jax._src import core

    monkeypatch.delattr(core, "get_axis_env")
    with pytest.raises(_compat.MissingJaxInternal, match="get_axis_env"):
        _compat.bound_axis_sizes()


def test_varying_axes_reads_the_type():
    assert _compat.varying_axes(jnp.zeros(3)) == frozenset()
    assert _compat.bound_axis_sizes() == {}
