"""The memory plan beside a GPU's measurement: each run of a scale-check report, planned again.

    python benchmarks/plan_vs_measured.py docs/gpu/h200_scale_check.md

For every complete run in the report's JSON block (benchmarks/scale_check.py), this plans the same
recast.py flags with benchmarks/memory_plan.py (on this CPU, SD3.5-Medium at its real size on
the meta device) and prints, per phase, the planned peak, the measured peak
(torch.cuda.max_memory_allocated, reset at each phase: recast.py's mem/<phase>) and planned ÷
measured. Flags that name the check's temporary files, device or length are left out; the
held-out prompts are the report's number of them.
"""

import contextlib
import io
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import memory_plan  # noqa: E402
from plumbing import cli  # noqa: E402

DROP = {"--model", "--prompts-file", "--eval-prompts-file", "--out", "--device", "--epochs",
        "--eval-every"}  # fmt: skip


def plan_flags(run: dict) -> list[str]:
    """The run's recast.py flags, as the planner takes them."""
    flags, out = run["flags"], []
    i = 0
    while i < len(flags):
        takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if flags[i] not in DROP:
            out += flags[i : i + 1 + takes_value]
        i += 1 + takes_value
    return out + ["--eval-prompts", str(run["settings"]["eval_prompts"]), "--no-suggest"]


PROG = "plan_vs_measured.py"


def read_report(path: str) -> dict:
    """The last JSON block of a scale check's report; a file that is missing, unreadable or holds
    no such block exits 2 naming it."""
    try:
        blocks = re.findall(r"```json\n(.*?)```", Path(path).read_text(), re.S)
        report = json.loads(blocks[-1]) if blocks else None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        cli.fail("REPORT", f"cannot read {path} ({e}): give a scale check's report, e.g. "
                 "docs/gpu/h200_scale_check.md", PROG)  # fmt: skip
    if not isinstance(report, dict) or not isinstance(report.get("runs"), dict):
        cli.fail("REPORT", f"{path} has no scale check's JSON block (```json with its runs): "
                 "give a report of benchmarks/scale_check.py, e.g. docs/gpu/h200_scale_check.md",
                 PROG)  # fmt: skip
    for name, run in report["runs"].items():
        ok = isinstance(run, dict) and (not run.get("complete") or (
            isinstance(run.get("flags"), list) and isinstance(run.get("mem_gib"), dict)
            and "eval_prompts" in (run.get("settings") or {})))  # fmt: skip
        if not ok:
            cli.fail("REPORT", f"{path}'s run {name!r} lacks what benchmarks/scale_check.py writes "
                     "for a complete run (flags, settings.eval_prompts, mem_gib): give a report "
                     "it wrote", PROG)  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("report", help="a scale check's report (scale_check.md)")
    args = ap.parse_args(argv)
    report = read_report(args.report)
    device = report.get("device", "a device the report does not name")
    print(f"{device}: measured by benchmarks/scale_check.py; planned here by "
          "benchmarks/memory_plan.py. Peak allocated GiB per phase.\n")  # fmt: skip
    print("| run | phase | planned | measured | planned ÷ measured |\n|---|---|---|---|---|")
    for name, run in report["runs"].items():
        if not run.get("complete"):
            continue
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
            path = os.path.join(tmp, "plan.json")
            memory_plan.main(plan_flags(run) + ["--json", path])
            peaks = json.loads(Path(path).read_text())["peaks"]
        for phase, measured in run["mem_gib"].items():
            planned = peaks[phase]["peak"] / memory_plan.GIB
            print(f"| {name} | {phase} | {planned:.2f} | {measured:.2f} | "
                  f"{planned / measured:.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
