import pytest


@pytest.fixture(scope="package")
def ray_cluster(tmp_path_factory):
    """One real two-node Ray cluster for the fleet tests (its start costs
    seconds of a 2-core host): a head offering "pnode", a node offering two
    "dnode" (room for a second decode core). Stopped after this package."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'kvferry[ray]')")
    from tests.fleet.ray_cluster import RayCluster

    with RayCluster(tmp_path_factory.mktemp("ray-cluster"), {"pnode": 1}, {"dnode": 2}) as cluster:
        yield cluster
