"""JUnit XML for ``medusa-export verify --junit`` (one test case per prompt)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path


def write_junit(path: str | Path, report) -> None:
    """Write a ValidationReport as a JUnit XML test suite."""
    fails = [report.failure(p) for p in report.prompts]
    suite = ET.Element("testsuite", name="medusa-export verify", tests=str(len(report.prompts)),
                       failures=str(sum(f is not None for f in fails)))
    for n, fail in enumerate(fails):
        case = ET.SubElement(suite, "testcase", classname=f"parity.{report.precision}", name=f"prompt_{n}")
        if fail:
            ET.SubElement(case, "failure", message=fail)
    ET.ElementTree(suite).write(str(path), encoding="utf-8", xml_declaration=True)
