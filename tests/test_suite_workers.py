"""How the suite spreads itself over pytest-xdist workers (tests/conftest.py)."""

import pytest

from tests.conftest import DEVICE_MODULES, auto_workers


def test_no_workers_unless_asked():
    assert auto_workers(None) == 0
    assert auto_workers("") == 0


def test_the_count_asked_for_and_a_negative_one_refused():
    assert auto_workers("3") == 3
    assert auto_workers("0") == 0
    with pytest.raises(ValueError, match="write a count >= 0"):
        auto_workers("-1")


def test_the_real_nccl_suite_shares_its_worker_with_the_doctor_probe():
    assert {"test_gpu.py", "test_cli.py"} <= set(DEVICE_MODULES)
