"""Under `pytest -n N --dist loadgroup`, a module's tests that share a module fixture of its own run on one worker
(helpers/workers.py): the fixture is built once, not once per worker."""

import pytest


@pytest.fixture(scope="module")
def built_once():
    return object()


def test_a_test_sharing_its_modules_fixture_is_in_the_modules_group(request, built_once):
    groups = [m.args[0] for m in request.node.iter_markers("xdist_group")]
    assert groups == ["tests/test_workers.py"]


def test_a_test_using_only_conftest_fixtures_goes_to_any_worker(request, one_thread, tmp_path):
    assert not list(request.node.iter_markers("xdist_group"))


@pytest.mark.xdist_group("own")
def test_a_tests_own_group_wins(request, built_once):
    assert [m.args[0] for m in request.node.iter_markers("xdist_group")] == ["own"]
