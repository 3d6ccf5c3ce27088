"""Ray on the GPU machine, as the colocated RL loop uses it (not part of `just test`).

    python3 tests/gpu/check_ray.py OUT_DIR

With the trimmed Ray (tests/gpu/README.md): `ray start --head` through the `ray` CLI as `molt-compile --submit`
starts it, then, in a placement group of one `{"GPU": 1, "CPU": 2}` bundle, two actors of `num_gpus=0.5` (a trainer
rank and an engine sharing the GPU): both must see the same one device, and a CUDA tensor exported by one through
`torch.multiprocessing.reductions.reduce_tensor` must read back in the other (what the `cuda_ipc` weight sync does).
Writes OUT_DIR/check_ray.json.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"ray_cli": shutil.which("ray")}
    port = _port()
    temp = tempfile.mkdtemp(prefix="molt-ray-", dir="/tmp")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    t0 = time.perf_counter()
    head = subprocess.Popen(["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=8", "--num-gpus=1",
                             f"--temp-dir={temp}", "--include-dashboard=false", "--disable-usage-stats"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    import ray
    import torch

    try:
        for _ in range(120):
            try:
                ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
                break
            except Exception:  # the head is still starting
                if head.poll() is not None:
                    raise RuntimeError(f"ray start exited {head.returncode}: {head.stdout.read()[-3000:]}") from None
                time.sleep(1)
        report["start_s"] = time.perf_counter() - t0
        report["version"] = ray.__version__
        report["resources"] = ray.cluster_resources()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = placement_group([{"GPU": 1, "CPU": 2}], strategy="PACK")
        ray.get(pg.ready(), timeout=120)

        @ray.remote(num_gpus=0.5, num_cpus=1)
        class Side:
            def where(self) -> dict:
                return {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "device_count": torch.cuda.device_count(), "gpu_ids": ray.get_gpu_ids()}

            def export(self, n: int):
                from torch.multiprocessing.reductions import reduce_tensor

                self.t = torch.arange(n, dtype=torch.float64, device="cuda")
                torch.cuda.synchronize()
                return reduce_tensor(self.t)

            def read(self, handle) -> float:
                rebuild, args = handle
                return float(rebuild(*args).sum())

        strat = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
        a, b = (Side.options(scheduling_strategy=strat).remote() for _ in range(2))
        report["where"] = ray.get([a.where.remote(), b.where.remote()])
        n = 1 << 20
        report["ipc_sum"] = ray.get(b.read.remote(ray.get(a.export.remote(n))))
        report["ipc_expected"] = float(n * (n - 1) / 2)
        ok = (report["ipc_sum"] == report["ipc_expected"]
              and all(w["device_count"] == 1 for w in report["where"]))
        report["ok"] = ok
    finally:
        ray.shutdown()
        head.terminate()
        head.wait(timeout=60)
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True)
    text = json.dumps(report, indent=1, default=str)
    print(text)
    (out / "check_ray.json").write_text(text)
    return 0 if report.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
