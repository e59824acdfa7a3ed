"""How long `serve.shutdown()` takes in Ray's throughput-optimized mode, by direct-ingress drain setting (CPU).

    python bench/serve_drain.py --drain default,0.5 --out bench/results/serve-drain-cpu/serve-drain.json

For each setting a fresh process starts a private Ray on 127.0.0.1 with RAY_SERVE_THROUGHPUT_OPTIMIZED=1
(and RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S unless `default`), deploys one trivial deployment,
checks that it answers over HTTP, and times `serve.shutdown()`. Ray 2.60 keeps a stopping direct-ingress
replica draining for that period (30 s by default) while `serve.shutdown()` gives up after 30 s
(docs/operations.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, sys, time, urllib.request
import ray
from ray import serve

@serve.deployment
class Echo:
    async def __call__(self, request):
        return "ok"

port = int(sys.argv[1])
ray.init(address="local", include_dashboard=False, num_cpus=2)
serve.start(http_options={"host": "127.0.0.1", "port": port})
serve.run(Echo.bind(), name="echo", route_prefix="/")
body = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30).read().decode()
t = time.monotonic()
serve.shutdown()
shutdown_s = time.monotonic() - t
ray.shutdown()
print(json.dumps({"answer": body, "shutdown_s": round(shutdown_s, 2)}))
"""


def run_one(drain: str, port: int) -> dict:
    env = os.environ | {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                        "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", None)
    if drain != "default":
        env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = drain
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(port)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"drain {drain}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    row = json.loads(lines[-1])
    if row["answer"] != "ok":
        raise RuntimeError(f"drain {drain}: unexpected answer {row['answer']!r}")
    return {"drain_s": drain, **row, "process_s": round(time.monotonic() - started, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drain", default="default,0.5", help="settings to time: `default` or seconds")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import ray

    result = {"bench": "serve_drain", "command": shlex.join(["python", "bench/serve_drain.py", *sys.argv[1:]]),
              "ray": ray.__version__, "runs": [run_one(d, args.port) for d in args.drain.split(",")]}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
