"""Turn the GPU check's JUnit XML files (one per stage) into one JSON report: each test's stage, outcome, time,
message and the figures it recorded (``record_property``, so that a passing test's numbers come back too), with the
device, torch and CUDA versions named. A stage stopped at its time limit still wrote its XML; a stage that wrote none
is listed as missing, and one whose XML cannot be parsed (pytest killed while writing it) as unreadable, with the
parser's error: the other stages are still reported.

    python scripts/gpu/gpu_report.py --out bench_results/gpu_tests.json DIR/gpu_fast.xml DIR/gpu_offload.xml ...
"""

from __future__ import annotations

import argparse
import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch


def _number(text: str | None) -> float | int | str | None:
    for kind in (int, float):
        try:
            return kind(text)
        except (TypeError, ValueError):
            pass
    return text


def read_stage(xml_path: Path) -> list[dict]:
    stage = xml_path.stem.removeprefix("gpu_")
    tests = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        if case.get("name") is None:  # the entry pytest leaves for a session stopped at its time limit
            continue
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (element.get("message") or "")[:500]
                break
        entry = {"stage": stage, "test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                 "seconds": float(case.get("time") or 0), "message": message}
        figures = {prop.get("name"): _number(prop.get("value")) for prop in case.iter("property")}
        if figures:  # what a test recorded with record_property, passed or not
            entry["figures"] = figures
        tests.append(entry)
    return tests


def main(xml_paths: list[Path], out_path: Path, env_path: Path | None = None) -> None:
    tests, missing, unreadable = [], [], {}
    for path in xml_paths:
        if not path.is_file():
            missing.append(path.name)
            continue
        try:
            tests += read_stage(path)
        except ET.ParseError as error:
            unreadable[path.name] = str(error)
    machine = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               "torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d")}
    if env_path is not None:  # reported elsewhere than where the tests ran: the machine as gpu_env.py recorded it
        env = json.loads(env_path.read_text())
        machine = {key: env.get(key) for key in ("device", "torch", "cuda")} | {"date": env["date"][:10]}
    report = {**machine,
              "counts": {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")},
              "missing_stages": missing, "unreadable_stages": unreadable, "tests": tests}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"gpu_report: {report['counts']} on {report['device']}"
          f"{'; no XML from ' + ', '.join(missing) if missing else ''}"
          f"{'; unreadable XML from ' + ', '.join(unreadable) if unreadable else ''} -> {out_path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSON report to write")
    parser.add_argument("--env", type=Path, default=None,
                        help="gpu_env.json of the machine the tests ran on (when reporting on another machine)")
    parser.add_argument("xml", type=Path, nargs="+", help="pytest's --junitxml outputs, one per stage")
    args = parser.parse_args()
    main(args.xml, args.out, args.env)
