"""What does ``memkit run`` cost a whole training script? Plain python against memkit run.

Run: ``python benchmarks/run_overhead.py`` (CPU, any machine; ``--rounds 3`` for a quicker
pass, ``--scripts nanogpt_train,mnist_examples`` for a subset, ``--json out.json`` for the raw
numbers).

Each script of ``tests/realworld/scripts/`` runs as a separate process in three variants:

* ``plain``: ``python SCRIPT ARGS``;
* ``memkit``: ``python -m memkit run --device cpu --budget B SCRIPT ARGS`` (the simulated
  device, hooks on every module);
* ``steps-only``: the same with ``--steps-only`` (hooks only at step boundaries).

The arguments are chosen so that a plain run spends a few seconds training, not only starting
up. The variants run round-robin, ``--rounds`` times, the first variant rotating every round,
so that drifts of the machine hit them alike. Per script the table gives the median wall time
of each variant and the ratios of the medians (memkit/plain, steps-only/plain), in wall time
and in CPU time (user + system of the process and its children: steadier than wall time on a
shared machine). The last row is the median of each ratio over the scripts. Start-up costs are
measured the same way: ``python -c "import torch"`` and ``memkit run`` of a script that only
imports torch.

Children get ``OMP_NUM_THREADS=--threads`` (default 1: with several intra-op threads, another
process on a small machine makes timings jump; ``--threads 0`` leaves the environment alone).
A run that exits with a code other than expected stops the benchmark with its stderr tail.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS_DIR = ROOT / "tests" / "realworld" / "scripts"
VARIANTS = ("plain", "memkit", "steps-only")


@dataclass
class Scenario:
    """A script of ``tests/realworld/scripts`` with the arguments the benchmark gives it."""

    script: str
    args: list[str] = field(default_factory=list)
    expect_rc: int = 0


SCENARIOS = {
    s.script.removesuffix(".py"): s
    for s in (
        Scenario("nanogpt_train.py", ["--max_iters", "80", "--eval_interval", "20"]),
        Scenario("mnist_examples.py", ["--epochs", "3", "--train-size", "2048"]),
        Scenario("word_language_model.py", ["--epochs", "6"]),
        Scenario("hf_trainer_bert.py", ["--max-steps", "100", "--eval-steps", "50"]),
        Scenario("host_ram_dataset.py", ["--steps", "400"]),
        Scenario("compiled_model.py", ["--steps", "400"]),
        Scenario("running_loss_graph.py", ["--samples", "4000", "--epochs", "1"]),
        Scenario("periodic_eval_leak.py", ["--steps", "500", "--eval-every", "50"]),
        Scenario("mingpt_adder.py", ["--max-iters", "100"]),
        Scenario("accelerate_clm.py", ["--max_train_steps", "12"]),
        Scenario("x_transformers_copy.py", ["--num-batches", "20"]),
        Scenario("time_sequence_lbfgs.py", ["--steps", "4"]),
    )
}


@dataclass
class Timing:
    """Wall and CPU seconds of one process run."""

    wall: float
    cpu: float


def command(variant: str, script: Path, args: list[str], budget: str) -> list[str]:
    """The command line of one variant."""
    if variant == "plain":
        return [sys.executable, str(script), *args]
    memkit = [sys.executable, "-m", "memkit", "run", "--device", "cpu", "--budget", budget]
    if variant == "steps-only":
        memkit.append("--steps-only")
    return [*memkit, str(script), *args]


def timed(cmd: list[str], env: dict[str, str], expect_rc: int, timeout: float) -> Timing:
    """Run ``cmd`` with its output captured; exit loudly if its exit code is not ``expect_rc``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise SystemExit(f"timed out after {timeout:.0f} s: {' '.join(cmd)}") from exc
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != expect_rc:
        tail = "\n".join(proc.stderr.splitlines()[-40:])
        raise SystemExit(
            f"exit code {proc.returncode} (expected {expect_rc}): {' '.join(cmd)}\n"
            f"--- stderr (tail) ---\n{tail}"
        )
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timing(wall, cpu)


def median_ratio(num: list[float], den: list[float]) -> float:
    """Ratio of the medians."""
    return statistics.median(num) / statistics.median(den)


def markdown(results: dict[str, dict[str, list[Timing]]], startup: dict[str, list[Timing]]) -> str:
    """The per-script table, the median of the ratios, and the start-up costs."""
    lines = [
        "| script | plain s | memkit s | steps-only s | memkit/plain | steps-only/plain "
        "| cpu memkit/plain | cpu steps-only/plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios: dict[str, list[float]] = {k: [] for k in ("m", "s", "cm", "cs")}
    for name, runs in results.items():
        wall = {v: [t.wall for t in runs[v]] for v in VARIANTS}
        cpu = {v: [t.cpu for t in runs[v]] for v in VARIANTS}
        row = {
            "m": median_ratio(wall["memkit"], wall["plain"]),
            "s": median_ratio(wall["steps-only"], wall["plain"]),
            "cm": median_ratio(cpu["memkit"], cpu["plain"]),
            "cs": median_ratio(cpu["steps-only"], cpu["plain"]),
        }
        for key, value in row.items():
            ratios[key].append(value)
        meds = " | ".join(f"{statistics.median(wall[v]):.2f}" for v in VARIANTS)
        lines.append(
            f"| {name} | {meds} | {row['m']:.2f}x | {row['s']:.2f}x "
            f"| {row['cm']:.2f}x | {row['cs']:.2f}x |"
        )
    if len(results) > 1:
        med = {k: statistics.median(v) for k, v in ratios.items()}
        lines.append(
            f"| **median of ratios** | | | | **{med['m']:.2f}x** | **{med['s']:.2f}x** "
            f"| {med['cm']:.2f}x | {med['cs']:.2f}x |"
        )
    lines.append("")
    for label, timings in startup.items():
        s_wall = statistics.median(t.wall for t in timings)
        s_cpu = statistics.median(t.cpu for t in timings)
        lines.append(f"start-up, {label}: {s_wall:.2f} s wall, {s_cpu:.2f} s cpu (median)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--scripts",
        default=",".join(SCENARIOS),
        help=f"comma-separated subset of: {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--budget", default="1GiB", help="simulated device size for memkit run")
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS of the runs (0: leave it alone)"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    args = parser.parse_args(argv)

    names = [s.strip().removesuffix(".py") for s in args.scripts.split(",") if s.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scripts: {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
    env = dict(os.environ)
    if args.threads > 0:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    threads = env.get("OMP_NUM_THREADS", "torch default")
    print(
        f"python {platform.python_version()}, {os.cpu_count()} cpus, threads {threads}, "
        f"budget {args.budget}, {args.rounds} rounds, scripts: {', '.join(names)}",
        flush=True,
    )

    results: dict[str, dict[str, list[Timing]]] = {n: {v: [] for v in VARIANTS} for n in names}
    startup: dict[str, list[Timing]] = {"python -c 'import torch'": [], "memkit run": []}
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "import_torch.py"
        empty.write_text("import torch\n")
        startup_cmds = {
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "memkit run": command("memkit", empty, [], args.budget),
        }
        for r in range(args.rounds):
            t_round = time.perf_counter()
            for label, cmd in startup_cmds.items():
                startup[label].append(timed(cmd, env, 0, args.timeout))
            for name in names:
                scenario = SCENARIOS[name]
                script = SCRIPTS_DIR / scenario.script
                order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
                for variant in order:
                    cmd = command(variant, script, scenario.args, args.budget)
                    results[name][variant].append(timed(cmd, env, scenario.expect_rc, args.timeout))
            print(f"round {r + 1}/{args.rounds}: {time.perf_counter() - t_round:.0f} s", flush=True)

    print()
    print(markdown(results, startup))
    if args.json is not None:
        raw = {
            "python": platform.python_version(),
            "threads": threads,
            "budget": args.budget,
            "rounds": args.rounds,
            "startup": {k: [vars(t) for t in v] for k, v in startup.items()},
            "scripts": {
                n: {
                    "script": SCENARIOS[n].script,
                    "args": SCENARIOS[n].args,
                    **{v: [vars(t) for t in results[n][v]] for v in VARIANTS},
                }
                for n in names
            },
        }
        args.json.write_text(json.dumps(raw, indent=2))
        print(f"\nraw numbers: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
