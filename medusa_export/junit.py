"""JUnit XML for ``medusa-export verify --junit`` (one test case per prompt)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path


def write_junit(path: str | Path, report) -> None:
    """Write a ValidationReport as a JUnit XML test suite."""
    fails = dict(zip([p.prompt for p in report.prompts], [None] * len(report.prompts)))
    for line, p in zip(report.failures(), [p for p in report.prompts if not (p.identical or p.near_tie)
                                           or not report._steps_ok(p)]):
        fails[p.prompt] = line
    suite = ET.Element("testsuite", name="medusa-export verify", tests=str(len(report.prompts)),
                       failures=str(sum(v is not None for v in fails.values())))
    for n, p in enumerate(report.prompts):
        case = ET.SubElement(suite, "testcase", classname=f"parity.{report.precision}", name=f"prompt_{n}")
        if fails[p.prompt]:
            ET.SubElement(case, "failure", message=fails[p.prompt])
    ET.ElementTree(suite).write(str(path), encoding="utf-8", xml_declaration=True)
