"""The GPU health checks against a real NVML: what the node agent sees on this machine's GPU 0.

Run by ``scripts/gpu_check.sh`` on a machine with an NVIDIA GPU (CI has none; the unit tests use a
fake NVML). Exits non-zero if a verdict is not the one a healthy GPU must get: GPU 0 reached by
index, by its full UUID and by a UUID prefix (as CUDA takes them in ``CUDA_VISIBLE_DEVICES``),
healthy, with an ECC baseline where the board has ECC and Xid events registered; a slot that
``CUDA_VISIBLE_DEVICES`` gives no GPU is not checked; an index NVML does not have is reported.
"""

from __future__ import annotations

import json
import sys

import pynvml

from ds_swift.launch.gpu_health import GpuMonitor, check_gpus, ecc_baseline


def main() -> int:
    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    uuid = pynvml.nvmlDeviceGetUUID(h)
    uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    print(f"NVML sees {count} GPU(s); GPU 0 is {pynvml.nvmlDeviceGetName(h)} {uuid}")
    envs = {
        "unset": {},
        "index 0": {"CUDA_VISIBLE_DEVICES": "0"},
        "uuid": {"CUDA_VISIBLE_DEVICES": uuid},
        "uuid prefix": {"CUDA_VISIBLE_DEVICES": uuid[:12]},
        "hidden (-1)": {"CUDA_VISIBLE_DEVICES": "-1"},
        f"NVML index {count} (none)": {"CUDA_VISIBLE_DEVICES": str(count)},
    }
    seen = {}
    for label, env in envs.items():
        base = ecc_baseline([0], environ=env)
        health = check_gpus([0], baseline=base, environ=env)
        monitor = GpuMonitor([0], environ=env)
        poll = monitor.poll()
        seen[label] = {
            "baseline": base,
            "checked": health.checked,
            "healthy": health.healthy,
            "problems": health.problems,
            "xid_events": monitor._events is not None,
            "poll_healthy": poll.healthy,
            "poll_problems": poll.problems,
        }
        print(f"{label:24s} {json.dumps(seen[label])}")
    bad = []
    for label in ("unset", "index 0", "uuid", "uuid prefix"):
        s = seen[label]
        if not (s["checked"] and s["healthy"] and s["poll_healthy"]):
            bad.append(f"{label}: GPU 0 not found healthy")
    if (
        seen["unset"]["baseline"] != seen["uuid"]["baseline"]
        or seen["unset"]["baseline"] != seen["uuid prefix"]["baseline"]
    ):
        bad.append("the ECC baseline differs between the index and the UUID of the same GPU")
    if seen["hidden (-1)"]["problems"]:
        bad.append("a hidden GPU was checked")
    absent = seen[f"NVML index {count} (none)"]
    if absent["healthy"] or not any("not reachable" in p for p in absent["problems"]):
        bad.append("an NVML index that does not exist was not reported")
    print("\n".join(bad) or "GPU health checks: all verdicts as expected")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
