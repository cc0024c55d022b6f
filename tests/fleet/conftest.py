import pytest


@pytest.fixture(scope="package")
def ray_cluster(tmp_path_factory):
    """One real two-node Ray cluster for the fleet tests (its start costs
    seconds of a 2-core host): a head offering "pnode", a node offering two
    "dnode" (room for a second decode core). Each node also offers "n0" or
    "n1" and 5 "rank", for test_ray_ranks.py's TP/PP/EP groups (resources of
    their own: the other modules' cores never ask for them, and those
    groups take no CPU, so the CPU the other modules count is the same).
    Stopped after this package."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'kvferry[ray]')")
    from tests.fleet.ray_cluster import RayCluster

    with RayCluster(tmp_path_factory.mktemp("ray-cluster"), {"pnode": 1, "n0": 1, "rank": 5},
                    {"dnode": 2, "n1": 1, "rank": 5}) as cluster:
        yield cluster
