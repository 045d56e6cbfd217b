"""The one GPU check that fits a lease (issue 52.3): ``make gpu-check``.

    python bench/gpu_check.py [--out DIR] [--device cuda|cpu] [--budget 480] [--carried DIR]

On a GPU host (no network; chunkq's other requirements carried as wheels: docs/development.md),
within ``--budget`` seconds (8 minutes by default), each step bounded by its share:
1. the GPU tier, ``tests/gpu`` (every test reached: per-test results and durations from its JUnit
   report; the two real-OOM tests run under ``--gpu-memory-limit 2GiB``);
2. ``bench/gpu.py`` at 20,000 MiniLM rows in fp32: plain, tuned plain, the forward alone (the
   ceiling), chunkq's defaults (``auto``: token budgets, tokenised ahead), batches of 32 (``fixed``)
   and the defaults tokenised behind (``behind``), tokenised once against twice;
3. MiniLM fp32 at 10^5 rows, whole commands only: plain against chunkq's defaults (the goal of
   issue 64 on a GPU host: the whole command >= 3x plain), cold and ``warm`` (workers forked by a
   standing fork server started before the command, as on a host's later runs);
4. the large model (bge-large's shape, fp16) at 4,000 rows: plain, tuned, ceiling, the defaults.
It writes ``DIR/gpu-check.json`` (every figure) and ``DIR/gpu-check.md`` (the summary that goes into
BENCHMARKS.md as it is), after every step, so a lease cut short keeps what was measured.

``--carried DIR``: what ``bench/gpu_carry.py pack`` put in DIR (the wheels the host lacks, the model's
folder) is installed there first and used throughout (``--model``, ``CHUNKQ_GPU_TEST_MODEL``).

``--device cpu`` runs the same steps on the CPU with small sizes (the tier then skips itself): what
``tests/house/test_gpu_check.py`` runs, so the command cannot rot between leases.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUDGET_SECONDS = 480.0
# Each step's share of the budget: the tier, MiniLM, MiniLM's whole command at 10^5, the large model
# (each of what is left when it starts).
SHARES = {"tier": 0.4, "minilm": 0.35, "whole": 0.5, "large": 1.0}
SIZES = {
    "cuda": {
        "rows": 20_000,
        "whole_rows": 100_000,
        "large_rows": 4_000,
        "configs": "auto,fixed,behind",
        "repeats": 2,
        "whole_configs": "auto,warm",
    },
    # Two repeats: both orders of the tokenised once/twice round, as on a GPU.
    # The whole step warm only: a cold run is the MiniLM step's (the CPU check tests the code, and
    # CI's suite is near its 15 minutes).
    "cpu": {
        "rows": 60,
        "whole_rows": 40,
        "large_rows": 0,
        "configs": "auto",
        "repeats": 2,
        "whole_configs": "warm",
    },
}
WHOLE_GOAL = 3.0  # issue 64: the whole command against plain encode, batch 32, at 10^5 MiniLM rows


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _bounded(cmd: list[str], seconds: float, log: Path) -> dict[str, Any]:
    """Run ``cmd`` for at most ``seconds`` (then killed), its output to ``log``: what it ended with."""
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
        try:
            code: int | None = proc.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
    found = {"exit_code": code, "timed_out": code is None, "seconds": round(time.monotonic() - started, 1)}
    if code != 0:  # a lease is too short to go looking: the summary says why the step stopped
        found["error"] = last_words(log)
    return found


def last_words(log: Path) -> str:
    """What a step that stopped said last: chunkq's own error line where there is one (a bench prints
    the failed run's stderr before its traceback), else the log's last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("chunkq: ")]
    return (said or lines or ["(no output)"])[-1][:300]


def gpu_tier(out: Path, seconds: float) -> dict[str, Any]:
    """tests/gpu under pytest, every test's outcome and duration from its JUnit report."""
    report = out / "gpu-tier.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-v", "--durations=0"]
    cmd += ["-p", "no:cacheprovider", f"--junitxml={report}"]
    found = _bounded(cmd, seconds, out / "gpu-tier.log")
    tests: list[dict[str, Any]] = []
    if report.is_file():
        for case in ET.parse(report).getroot().iter("testcase"):  # noqa: S314 - pytest's own report
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    why = (node.get("message") or "").splitlines()
                    case.set("why", why[0][:300] if why else "")
            tests.append(
                {
                    "test": f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}",
                    "outcome": outcome,
                    "seconds": round(float(case.get("time") or 0), 1),
                    **({"why": case.get("why")} if case.get("why") else {}),
                }
            )
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    return {**found, "counts": counts, "tests": tests}


def bench(out: Path, name: str, args: list[str], seconds: float) -> dict[str, Any]:
    figures = out / f"bench-{name}.json"
    found = _bounded(
        [sys.executable, "bench/gpu.py", *args, "--out", str(figures)], seconds, out / f"bench-{name}.log"
    )
    try:
        found["figures"] = json.loads(figures.read_text())
    except (OSError, ValueError):
        found["figures"] = None
    return found


def _rate(figure: dict[str, Any] | None) -> str:
    if not figure:
        return "-"
    rate = figure.get("rows_per_s")
    return f"{rate:,.0f}" if isinstance(rate, int | float) else "-"


def _stopped(step: dict[str, Any]) -> str:
    """How a step that did not finish cleanly ended, in words; empty for one that did."""
    if step["timed_out"]:
        return f"cut at its time limit: {step.get('error', '')}"
    return f"exit {step['exit_code']}: {step.get('error', '')}" if step["exit_code"] != 0 else ""


def markdown(result: dict[str, Any]) -> str:
    """The summary that goes into BENCHMARKS.md as it is."""
    lines = [
        f"### GPU check, {result['started'][:16]} UTC: {result['device_name']}",
        "",
        f"`make gpu-check` ({result['device']}), {result['seconds']:.0f} s of a "
        f"{result['budget']:.0f} s budget.",
        "",
    ]
    tier = result.get("tier")
    if tier:
        c = tier["counts"]
        state = _stopped(tier) or "exit 0"
        lines += [
            f"**GPU tier** ({state}, {tier['seconds']:.0f} s): {c['passed']} passed, {c['failed']} failed, "
            f"{c['error']} errors, {c['skipped']} skipped.",
            "",
            "| test | outcome | s |",
            "|---|---|---|",
            *(
                f"| {t['test']} | {t['outcome']}{': ' + t['why'] if t.get('why') else ''} | {t['seconds']} |"
                for t in tier["tests"]
            ),
            "",
        ]
    steps = (
        ("minilm", "MiniLM fp32", "minilm"),
        ("whole", f"MiniLM fp32, the whole command (goal: >= {WHOLE_GOAL:g}x plain end to end)", "minilm"),
        ("large", "bge-large shape fp16", "large"),
    )
    for key, title, model in steps:
        step = result.get(key)
        figures = ((step or {}).get("figures") or {}).get(model)
        if not step:
            continue
        stopped = _stopped(step)
        if not figures:
            lines += [f"**{title}**: no figures ({stopped or 'exit 0'}, {step['seconds']:.0f} s).", ""]
            continue
        lines += [f"**{title}** ({step['seconds']:.0f} s{'; ' + stopped if stopped else ''}):", ""]
        lines += ["| what | rows/s | notes |", "|---|---|---|"]
        for name in ("plain", "plain_tuned", "st_pool", "ceiling"):
            if name in figures:
                lines.append(f"| {name} | {_rate(figures[name])} | |")
        for name, figure in figures.items():
            if isinstance(figure, dict) and "steady_ratio" in figure:
                util, share = figure.get("gpu_util"), figure.get("share_of_ceiling")
                notes = (
                    f"steady {figure.get('steady_ratio', 0):.2f}x plain, end to end "
                    f"{figure.get('e2e_ratio', 0):.2f}x, {'-' if not share else f'{100 * share:.0f}'} % "
                    f"of the ceiling, GPU {'-' if util is None else f'{util:.0f}'} %, first rows "
                    f"{figure.get('first_rows_seconds') or 0:.1f} s, host memory (PSS) "
                    f"{(figure.get('peak_pss_bytes') or 0) / 2**30:.1f} GiB in all, "
                    f"{(figure.get('largest_process_pss_bytes') or 0) / 2**30:.2f} GiB the largest process"
                )
                if figure.get("standing_refused"):  # then no warmer than the defaults: say why
                    notes += f"; **the standing fork server was refused**: {figure['standing_refused']}"
                lines.append(f"| chunkq {name} | {_rate(figure)} | {notes} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budget", type=float, default=BUDGET_SECONDS, help="seconds for all steps")
    parser.add_argument("--carried", type=Path, default=None, help="a folder gpu_carry.py packed")
    args = parser.parse_args()
    if args.carried is not None:
        sys.path.insert(0, str(ROOT / "bench"))
        from gpu_carry import unpack

        for name, value in unpack(args.carried).items():
            joined = [value, os.environ.get(name, "")] if name == "PYTHONPATH" else [value]
            os.environ[name] = os.pathsep.join(filter(None, joined))
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = SIZES[args.device]
    started, deadline = time.monotonic(), time.monotonic() + args.budget
    result: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(),
        "device": args.device,
        "device_name": _device_name(args.device),
        "budget": args.budget,
    }

    def left(share: float) -> float:
        return max(1.0, (deadline - time.monotonic()) * share)

    def save() -> None:
        result["seconds"] = time.monotonic() - started
        (args.out / "gpu-check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (args.out / "gpu-check.md").write_text(markdown(result))

    common = ["--device", args.device]
    if os.environ.get("CHUNKQ_GPU_TEST_MODEL"):  # the bundled model's package is not on the host
        common += ["--model", os.environ["CHUNKQ_GPU_TEST_MODEL"]]
    rounds = ["--repeats", str(sizes["repeats"])]  # tokenised once against twice
    result["tier"] = gpu_tier(args.out, left(SHARES["tier"]))
    save()
    minilm = ["--rows", str(sizes["rows"]), "--large-rows", "0", "--configs", sizes["configs"], "--baselines"]
    result["minilm"] = bench(args.out, "minilm", [*common, *rounds, *minilm], left(SHARES["minilm"]))
    save()
    # Whole commands only: plain and the defaults, no baselines, no tokenisation rounds.
    # "warm": a host's later runs, whose workers a standing fork server forks (its start not counted).
    whole = ["--rows", str(sizes["whole_rows"]), "--large-rows", "0", "--configs", sizes["whole_configs"]]
    whole.append("--no-baselines")
    result["whole"] = bench(args.out, "whole", [*common, "--repeats", "0", *whole], left(SHARES["whole"]))
    save()
    if sizes["large_rows"]:
        large = ["--rows", "0", "--large-rows", str(sizes["large_rows"]), "--configs", "auto", "--baselines"]
        result["large"] = bench(args.out, "large", [*common, *rounds, *large], left(SHARES["large"]))
        save()
    print(markdown(result))


def _device_name(device: str) -> str:
    if device == "cpu":
        return f"CPU, {os.cpu_count()} cores"
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return str(name.decode() if isinstance(name, bytes) else name)
    except Exception as exc:
        return f"a GPU NVML cannot name ({type(exc).__name__})"


if __name__ == "__main__":
    main()
