"""How workers sharing a machine split its cores."""
from services.worker.cpu_cores import format_cores, parse_cores, split_cores


def test_split_cores_is_disjoint_and_balanced():
    assert split_cores([0, 1], 2) == [[0], [1]]
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cores(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert split_cores([4, 5], 1) == [[4, 5]]


def test_more_workers_than_cores_share_round_robin():
    assert split_cores([0, 1], 3) == [[0], [1], [0]]


def test_core_lists_round_trip():
    assert parse_cores("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cores(format_cores([2, 5, 7])) == [2, 5, 7]
