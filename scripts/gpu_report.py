"""Turn the GPU suite's JUnit XML into ``bench_results/gpu_tests.json``: each test's outcome and time, with the
device, torch and CUDA versions named.

    python scripts/gpu_report.py /tmp/gpu_check/gpu_tests.xml bench_results/gpu_tests.json
"""

from __future__ import annotations

import argparse
import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch


def main(xml_path: str, out_path: str) -> None:
    tests = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (element.get("message") or "")[:500]
                break
        else:
            message = ""
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "message": message})
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
              "torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"),
              "counts": {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")},
              "tests": tests}
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(report, indent=2) + "\n")
    print(f"gpu_report: {report['counts']} on {report['device']} -> {out_path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("xml", help="pytest's --junitxml output")
    parser.add_argument("out", help="the JSON report to write")
    args = parser.parse_args()
    main(args.xml, args.out)
