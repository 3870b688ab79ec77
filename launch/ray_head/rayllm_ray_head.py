"""What a Ray head this project starts needs beyond `ray start` flags (jobs/submit_local.py, launch/slurm).

Every port of such a head is bound by the process that listens (`--port=0`, `--dashboard-port=0`,
`--dashboard-agent-listen-port=0`) and read back from where Ray publishes it; see docs/launch.md.

    RAY_START_HOOK=rayllm_ray_head.no_client_server  (this directory on `ray start`'s PYTHONPATH)
        no Ray client server: Ray 2.60 refuses port 0 for it (1024-65535 only) and a `--block` head
        whose client server cannot bind its port stops altogether; these launchers never use it.
    python launch/ray_head/rayllm_ray_head.py dashboard HOST:GCS_PORT [TIMEOUT_S]
        prints the head's dashboard address (http://host:port), as its dashboard published it in the GCS.
"""
from __future__ import annotations

import os
import sys

HOOK = "rayllm_ray_head.no_client_server"
"""RAY_START_HOOK value; `ray start` imports it with HOOK_DIR on PYTHONPATH."""
HOOK_DIR = os.path.dirname(os.path.abspath(__file__))
ADDRESS_FILE = "ray_current_cluster"
"""`ray start` writes the GCS address here, in its --temp-dir, once the head (dashboard included) is up."""


def no_client_server(ray_params, head: bool) -> None:
    """`ray start` hook: start no Ray client server on the head (Ray skips it when the port is None)."""
    if head:
        ray_params.ray_client_server_port = None


def read_gcs_address(temp_dir: str) -> str:
    """The head's GCS host:port from `<temp_dir>/ray_current_cluster`; "" while not (fully) written."""
    try:
        with open(os.path.join(temp_dir, ADDRESS_FILE)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return ""
    host, _, port = text.rpartition(":")
    return text if host and port.isdigit() and int(port) > 0 else ""


def dashboard_address(gcs_address: str, timeout_s: float = 30.0) -> str:
    """http://host:port of the head's dashboard, from the GCS key its dashboard wrote when it bound.

    Needs the head's auth settings in the environment (RAY_AUTH_MODE and the token)."""
    from ray._raylet import GcsClient

    value = GcsClient(address=gcs_address).internal_kv_get(b"dashboard", namespace=b"dashboard", timeout=timeout_s)
    if not value:
        raise RuntimeError(f"the Ray head at {gcs_address} published no dashboard address "
                           "(start it with --include-dashboard=true)")
    return f"http://{value.decode()}"


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] != "dashboard":
        sys.exit("usage: rayllm_ray_head.py dashboard HOST:GCS_PORT [TIMEOUT_S]")
    print(dashboard_address(sys.argv[2], float(sys.argv[3]) if len(sys.argv) == 4 else 30.0))
