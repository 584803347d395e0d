"""Under `pytest -n N --dist loadgroup`, a module's tests that share a module fixture of its own run on one worker
(helpers/workers.py): the fixture is built once, not once per worker."""

import pytest


@pytest.fixture(scope="module")
def built_once():
    return object()


def test_a_test_sharing_its_modules_fixture_is_in_the_modules_group(request, built_once):
    groups = [m.args[0] for m in request.node.iter_markers("xdist_group")]
    assert groups == ["tests/test_workers.py"]
    if getattr(request.config.option, "loadgroup", False):  # a worker under --dist loadgroup: xdist schedules by the id
        assert request.node.nodeid.endswith("@tests/test_workers.py"), request.node.nodeid


def test_the_groups_are_marked_before_pytest_xdist_reads_them(request):
    """xdist reads each test's group in its own collection hook: ours wraps it, marking the groups before and
    naming the ids after (a mark added after it schedules nothing, and each worker builds a module's fixtures)."""
    hooks = request.config.pluginmanager.hook.pytest_collection_modifyitems.get_hookimpls()
    ours = next(h for h in hooks if h.plugin_name.endswith("tests/conftest.py"))
    assert ours.wrapper


def test_a_test_using_only_conftest_fixtures_goes_to_any_worker(request, one_thread, tmp_path):
    assert not list(request.node.iter_markers("xdist_group"))


@pytest.mark.xdist_group("own")
def test_a_tests_own_group_wins(request, built_once):
    assert [m.args[0] for m in request.node.iter_markers("xdist_group")] == ["own"]
    if getattr(request.config.option, "loadgroup", False):
        assert request.node.nodeid.endswith("@own"), request.node.nodeid
