"""Two processes on one GPU, as the LLM and vocoder replicas share it: how long does a latency-bound chain
of small kernels (vocoder-like) take while a bandwidth-bound decode loop (LLM-like) runs beside it, under
GPU time-slicing, under MPS, and under MPS with the decode process at a lower MPS client priority
(`CUDA_MPS_CLIENT_PRIORITY=1`) or fewer SMs (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`)?

    python bench/mps_priority.py --out bench/results/mps-priority-h200/mps-priority.json

Scenarios (one orchestrating process that never touches CUDA; each scenario starts fresh processes):
- `victim_alone`, `competitor_alone`: each workload by itself (no MPS), the baselines;
- `slicing`: both at once without MPS (the GPU alternates between the two contexts);
- `mps`, `mps_low`, `mps_low_pct<N>`: both at once under an MPS daemon this script starts and stops
  (pipe and logs under /tmp/mps-priority); the competitor at normal priority, at below-normal priority,
  and at below-normal priority limited to N % of the SMs.
The victim step is `--victim-replays` replays of one CUDA graph of `--victim-layers` small
matmul + activation layers (64 x 512 rows, bf16; ~3 kernels each), timed wall-clock to the host from the
launch to a synchronize, with `--victim-gap-ms` of sleep between steps so steps start at random phases of
the competitor's. The competitor step is one CUDA graph of `--competitor-layers` decode-like layers for 64
rows (QKV, O, gate/up, down matmuls of Qwen3-8B's shapes over four weight sets, ~1.5 GB, cycled so that
nothing stays in L2), then a synchronize, as the engine reads its sampled tokens. Both outputs are
checked finite and the victim's output equal in every scenario before any figure is kept.
Prints one JSON line; --out writes it too.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.measure import percentiles  # the repo root is on sys.path now

MPS_DIR = Path("/tmp/mps-priority")


# ---------------------------------------------------------------- workloads (run in child processes)
def capture(fn):
    """`fn` run twice on a side stream (warm-up), then captured as one CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def victim(args: argparse.Namespace, work: Path) -> None:
    import torch

    torch.manual_seed(0)
    dev = torch.device("cuda")
    weights = [torch.randn(512, 512, device=dev, dtype=torch.bfloat16) / 23 for _ in range(8)]
    x0 = torch.randn(64, 512, device=dev, dtype=torch.bfloat16)
    x = x0.clone()

    def chain() -> None:
        h = x
        for i in range(args.victim_layers):
            h = torch.nn.functional.silu(h @ weights[i % 8]) + h * 0.5
        x.copy_(h / h.abs().amax().clamp(min=1))

    graph = capture(chain)

    def step() -> float:
        t0 = time.perf_counter()
        for _ in range(args.victim_replays):
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(3):
        step()
    while args.wait_for_competitor and not (work / "competitor_ready").exists():
        time.sleep(0.05)
    x.copy_(x0)
    torch.cuda.synchronize()
    (work / "window_start").write_text(str(time.time()))
    times, rng = [], random.Random(0)
    for _ in range(args.victim_steps):
        times.append(step())
        time.sleep(rng.uniform(0, 2 * args.victim_gap_ms) / 1e3)
    (work / "window_end").write_text(str(time.time()))
    out = x.float()
    (work / "victim.json").write_text(json.dumps({
        "step_ms": times, "finite": bool(torch.isfinite(out).all()), "checksum": float(out.double().sum())}))


def competitor(args: argparse.Namespace, work: Path) -> None:
    import torch

    torch.manual_seed(1)
    dev, dt, rows, hidden = torch.device("cuda"), torch.bfloat16, 64, 4096
    shapes = [(hidden, 6144), (hidden, hidden), (hidden, 24576), (12288, hidden)]  # qkv, o, gate_up, down
    sets = [[torch.randn(k, n, device=dev, dtype=dt) / k ** 0.5 for k, n in shapes] for _ in range(4)]
    x = torch.randn(rows, hidden, device=dev, dtype=dt)

    def decode_step() -> None:
        h = x
        for layer in range(args.competitor_layers):
            qkv, o, gate_up, down = sets[layer % 4]
            a = (h @ qkv)[:, :hidden]
            h = h + a @ o
            g, u = (h @ gate_up).chunk(2, dim=-1)
            h = h + (torch.nn.functional.silu(g) * u) @ down
            h = h / h.abs().amax(dim=-1, keepdim=True).clamp(min=1)
        x.copy_(h)

    graph = capture(decode_step)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    (work / "competitor_ready").write_text("1")
    stamps = []
    deadline = time.time() + args.competitor_max_s
    while not (work / "stop").exists() and time.time() < deadline:
        t0 = time.time()
        graph.replay()
        torch.cuda.synchronize()
        stamps.append((t0, time.time()))
    out = x.float()
    (work / "competitor.json").write_text(json.dumps({"stamps": stamps, "finite": bool(torch.isfinite(out).all())}))


# ---------------------------------------------------------------- orchestration (no CUDA here)
def child(role: str, args: argparse.Namespace, work: Path, env: dict[str, str], wait: bool) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--role", role, "--work", str(work),
           "--victim-layers", str(args.victim_layers), "--victim-replays", str(args.victim_replays),
           "--victim-steps", str(args.victim_steps), "--victim-gap-ms", str(args.victim_gap_ms),
           "--competitor-layers", str(args.competitor_layers), "--competitor-max-s", str(args.competitor_max_s)]
    if wait:
        cmd.append("--wait-for-competitor")
    return subprocess.Popen(cmd, env=env)


def run_scenario(name: str, args: argparse.Namespace, *, victim_on: bool, competitor_env: dict[str, str] | None,
                 base_env: dict[str, str]) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"mpsprio-{name}-"))
    procs = []
    comp = None
    if competitor_env is not None:
        comp = child("competitor", args, work, {**base_env, **competitor_env}, wait=False)
        procs.append(comp)
    if victim_on:
        vic = child("victim", args, work, base_env, wait=comp is not None)
        procs.append(vic)
        rc = vic.wait(timeout=args.scenario_timeout_s)
        if rc != 0:
            raise RuntimeError(f"{name}: victim exited {rc}")
    else:
        deadline = time.time() + args.scenario_timeout_s
        while not (work / "competitor_ready").exists():
            if time.time() > deadline or comp.poll() is not None:
                raise RuntimeError(f"{name}: competitor never became ready")
            time.sleep(0.05)
        (work / "window_start").write_text(str(time.time()))
        time.sleep(args.competitor_alone_s)
        (work / "window_end").write_text(str(time.time()))
    if comp is not None:
        (work / "stop").write_text("1")
        if comp.wait(timeout=60) != 0:
            raise RuntimeError(f"{name}: competitor exited {comp.returncode}")
    start, end = (float((work / f).read_text()) for f in ("window_start", "window_end"))
    result: dict = {"scenario": name, "window_s": round(end - start, 3)}
    if competitor_env is not None:
        result["competitor_env"] = competitor_env
    if victim_on:
        v = json.loads((work / "victim.json").read_text())
        result["victim_step_ms"] = percentiles(v["step_ms"])
        result["victim_finite"], result["victim_checksum"] = v["finite"], v["checksum"]
    if comp is not None:
        c = json.loads((work / "competitor.json").read_text())
        inside = [b - a for a, b in c["stamps"] if a >= start and b <= end]
        result["competitor_step_ms"] = percentiles([1e3 * s for s in inside]) if inside else None
        result["competitor_steps_per_s"] = round(len(inside) / (end - start), 2)
        result["competitor_finite"] = c["finite"]
    return result


def mps_daemon(start: bool, env: dict[str, str]) -> None:
    if start:
        (MPS_DIR / "pipe").mkdir(parents=True, exist_ok=True)
        (MPS_DIR / "log").mkdir(parents=True, exist_ok=True)
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
    else:
        subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", env=env, check=True)
        for _ in range(100):  # the server leaves shortly after "quit"
            if subprocess.run(["pgrep", "-f", "nvidia-cuda-mps"], check=False, capture_output=True).returncode != 0:
                return
            time.sleep(0.1)
        raise RuntimeError("the MPS daemon did not stop")


def orchestrate(args: argparse.Namespace) -> dict:
    base = dict(os.environ)
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_CLIENT_PRIORITY",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        base.pop(key, None)
    result: dict = {"bench": "mps_priority", "command": "python " + shlex.join(sys.argv),
                    "settings": {k: getattr(args, k) for k in ("victim_layers", "victim_replays", "victim_steps",
                                                               "victim_gap_ms", "competitor_layers",
                                                               "competitor_alone_s")}}
    info = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                          check=False, capture_output=True, text=True)
    result["device"] = info.stdout.strip()
    rows = [run_scenario("victim_alone", args, victim_on=True, competitor_env=None, base_env=base),
            run_scenario("competitor_alone", args, victim_on=False, competitor_env={}, base_env=base),
            run_scenario("slicing", args, victim_on=True, competitor_env={}, base_env=base)]
    mps_env = {**base, "CUDA_MPS_PIPE_DIRECTORY": str(MPS_DIR / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(MPS_DIR / "log")}
    mps_daemon(True, mps_env)
    try:
        rows.append(run_scenario("mps_competitor_alone", args, victim_on=False, competitor_env={}, base_env=mps_env))
        rows.append(run_scenario("mps", args, victim_on=True, competitor_env={}, base_env=mps_env))
        rows.append(run_scenario("mps_low", args, victim_on=True, competitor_env={"CUDA_MPS_CLIENT_PRIORITY": "1"},
                                 base_env=mps_env))
        for pct in args.thread_percentages:
            rows.append(run_scenario(f"mps_low_pct{pct}", args, victim_on=True, base_env=mps_env, competitor_env={
                "CUDA_MPS_CLIENT_PRIORITY": "1", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct)}))
    finally:
        mps_daemon(False, mps_env)
        logs = sorted((MPS_DIR / "log").glob("*.log"))
        result["mps_server_log_priority_lines"] = [
            line for p in logs for line in p.read_text(errors="replace").splitlines()
            if "riority" in line or "Percentage" in line][:40]
    checks = {r["victim_checksum"] for r in rows if "victim_checksum" in r}
    result["verified"] = (len(checks) == 1 and all(r.get("victim_finite", True) and r.get("competitor_finite", True)
                                                    for r in rows))
    result["scenarios"] = rows
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("orchestrate", "victim", "competitor"), default="orchestrate")
    p.add_argument("--work", type=Path)
    p.add_argument("--victim-layers", type=int, default=300)
    p.add_argument("--victim-replays", type=int, default=8)
    p.add_argument("--victim-steps", type=int, default=60)
    p.add_argument("--victim-gap-ms", type=float, default=20.0)
    p.add_argument("--wait-for-competitor", action="store_true")
    p.add_argument("--competitor-layers", type=int, default=36)
    p.add_argument("--competitor-max-s", type=float, default=120.0)
    p.add_argument("--competitor-alone-s", type=float, default=4.0)
    p.add_argument("--thread-percentages", type=lambda s: [int(x) for x in s.split(",") if x], default=[75])
    p.add_argument("--scenario-timeout-s", type=float, default=120.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.role == "victim":
        return victim(args, args.work)
    if args.role == "competitor":
        return competitor(args, args.work)
    result = orchestrate(args)
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
