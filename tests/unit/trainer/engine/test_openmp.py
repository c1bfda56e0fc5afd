import os

import pytest

from trainer.engine.openmp import OPENMP_DEFAULTS, set_openmp_defaults


@pytest.mark.parametrize("given", [{}, {"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"},
                                   {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300000"}])
def test_the_defaults_apply_only_where_the_caller_chose_neither_variable(monkeypatch, given):
    for name in OPENMP_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    set_openmp_defaults()
    assert {name: os.environ.get(name) for name in OPENMP_DEFAULTS} == (
        {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"} if not given
        else {name: given.get(name) for name in OPENMP_DEFAULTS})
