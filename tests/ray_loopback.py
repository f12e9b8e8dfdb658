"""Ray's own ``ray`` CLI, keeping a loopback address as given: several nodes of one cluster on this
machine, all on 127.0.0.1 (tests/pipeline/test_kuberay.py).

With multi-node enabled (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` unset on Linux, as in the KubeRay
image) Ray 2.60's CLI replaces ``--node-ip-address=127.0.0.1`` and ``--address=127.0.0.1:PORT``
by the machine's external address (``ray._private.services.resolve_ip_for_localhost``), so the
nodes would listen on the external interface; with it set to ``0`` the CLI refuses ``ray start
--address`` (ray/scripts/scripts.py). Pods on Kubernetes have their own addresses and need
neither. This runs the CLI unchanged but for that replacement:

    python tests/ray_loopback.py start --head --node-ip-address=127.0.0.1 --port=PORT ...
    python tests/ray_loopback.py start --address=127.0.0.1:PORT --node-ip-address=127.0.0.1 ...
"""

import sys

import ray._private.services as services
from ray.scripts.scripts import main

services.resolve_ip_for_localhost = lambda host: host  # 127.0.0.1 stays 127.0.0.1

if __name__ == "__main__":
    sys.argv[0] = "ray"
    main()
