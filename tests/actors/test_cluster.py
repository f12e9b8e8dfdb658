import pytest

pytestmark = pytest.mark.ray


def test_cluster_is_local_and_loopback(ray_cluster):
    import ray

    assert ray.cluster_resources()["CPU"] == 4
    assert ray_cluster.dashboard_url.startswith("http://127.0.0.1:")

    @ray.remote(num_cpus=1)
    def where():
        return ray.util.get_node_ip_address()

    assert ray.get(where.remote(), timeout=60) == "127.0.0.1"
