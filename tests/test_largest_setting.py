"""experiments/largest_setting.py: the search for the largest setting that runs."""

import pytest

from experiments.largest_setting import Search


def run_search(search: Search, edge: float, cut=()) -> list:
    """Run the search against a machine where settings up to ``edge`` fit; the
    settings in ``cut`` say nothing the first time they run."""
    tried, cut = [], list(cut)
    while not search.done():
        value = search.next()
        tried.append(value)
        if value in cut:
            cut.remove(value)
            search.record(value, None)
        else:
            search.record(value, value <= edge)
    return tried


def test_the_search_bisects_the_grid_to_the_last_setting_that_fits():
    search = Search(1.0, 0.5, 5.0)
    assert search.grid == [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0]
    tried = run_search(search, edge=3.2)
    assert tried == [3.0, 4.0, 3.5]  # the middle first: 3 runs for 9 settings
    assert (search.largest_fit, search.smallest_fail) == (3.0, 3.5)
    assert search.as_dict()["done"] and not search.as_dict()["grid_top_fits"]


def test_the_grid_top_fitting_ends_the_search_there_and_says_so():
    search = Search(1.0, 1.0, 4.0)
    assert run_search(search, edge=10.0) == [2.0, 3.0, 4.0]
    assert search.largest_fit == 4.0 and search.as_dict()["grid_top_fits"]


def test_the_lowest_setting_runs_only_when_everything_above_it_failed():
    search = Search(1.0, 1.0, 4.0)
    assert run_search(search, edge=1.5) == [2.0, 1.0]
    assert (search.largest_fit, search.smallest_fail) == (1.0, 2.0)
    low_fails = Search(1.0, 1.0, 4.0)
    assert run_search(low_fails, edge=0.5) == [2.0, 1.0]
    assert low_fails.largest_fit is None and "lowest setting 1.0 does not fit" in low_fails.stuck()


@pytest.mark.parametrize("edge", [0.9, 1.0, 1.7, 2.0, 2.2, 3.0, 3.9, 4.0, 5.0, 6.0])
def test_every_answer_is_a_setting_that_ran_with_its_neighbour_seen_failing(edge):
    search = Search(1.0, 0.5, 5.0)
    tried = run_search(search, edge=edge)
    assert len(tried) <= 4 and len(set(tried)) == len(tried)  # ceil(log2(9 + 1)), no repeats
    fit = search.largest_fit
    expected = max((v for v in search.grid if v <= edge), default=None)
    assert fit == expected
    if fit is not None:
        assert search.outcome(fit) is True  # it ran, it was not only implied
    if fit != search.high:
        above = search.low if fit is None else search.value(search.index(fit) + 1)
        assert search.outcome(above) is False


def test_a_run_that_says_nothing_is_tried_again_once_then_the_search_stops():
    search = Search(1.0, 1.0, 4.0)
    assert run_search(search, edge=2.0, cut=[3.0]) == [2.0, 3.0, 3.0]
    assert search.largest_fit == 2.0 and search.smallest_fail == 3.0
    stuck = Search(1.0, 1.0, 4.0)
    stuck.record(2.0, True)
    stuck.record(3.0, None)
    stuck.record(3.0, None)
    assert stuck.next() is None and "neither fitted nor ran out of memory" in stuck.stuck()


def test_settings_off_the_grid_and_a_bad_grid_are_refused():
    with pytest.raises(ValueError, match="not on the grid"):
        Search(1.0, 0.5, 3.0).record(1.2, True)
    with pytest.raises(ValueError, match="step > 0"):
        Search(1.0, 0.0, 3.0)


def test_a_failure_below_a_fit_is_named_not_bisected():
    search = Search(1.0, 1.0, 4.0)
    search.record(1.0, True)
    search.record(4.0, False)
    search.record(3.0, True)
    search.record(2.0, False)
    assert search.next() is None and "does not fit monotonically" in search.stuck()


def test_the_search_reads_back_from_its_dict():
    search = Search(0.027, 0.0039, 0.0465)
    run_search(search, edge=0.035)
    again = Search.from_dict(search.as_dict())
    assert again.as_dict() == search.as_dict() and again.largest_fit == 0.0348
