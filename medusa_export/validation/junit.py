"""JUnit XML for ``medusa-export verify --junit``: one test case per prompt of each parity check that ran, and
one for the weights' checksums when that check ran (so that a CI reading the report fails where verify does).
A passing case that rests on a near-tie says so (its step and margin) in its ``system-out`` and properties."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

PARITY_CHECKS = ("full", "truncated", "gpu")  # records in ValidationReport's JSON form


def junit_cases(result: dict) -> list[tuple[str, str, str | None, str | None]]:
    """The test cases of a :func:`~.checks.run_checks` result, in the order the checks ran.

    Args:
        result: ``run_checks``'s dict (``ran`` names the checks; the full check's report is at its top level,
            every other check's record under its name).

    Returns:
        ``(classname, name, failure message or None, note or None)`` per case: ``parity.<precision>`` /
        ``prompt_<n>`` for the full check (the names verify has always written), ``<check>.<precision>`` /
        ``prompt_<n>`` for the truncated and gpu checks, ``self`` / ``prompt_<n>`` for the self check,
        ``checksums`` / ``weights`` for the checksums check. The note is a parity case's near-tie
        (:func:`~.report.near_tie_note`: new token, tree step, reference margin).
    """
    from .checks import check_record, self_failure
    from .report import NOTHING_COMPARED, ValidationReport, near_tie_note

    cases = []
    for check in result["ran"]:
        rec = check_record(result, check)
        if check == "checksums":
            cases.append(("checksums", "weights", None if rec["passed"] else rec["error"], None))
        elif check == "self":
            none = None if any(p["tokens"] for p in rec["prompts"]) else NOTHING_COMPARED
            cases += [("self", f"prompt_{n}", self_failure(p) or none, None) for n, p in enumerate(rec["prompts"])]
        elif check in PARITY_CHECKS:
            report = ValidationReport.from_json(rec)
            group = "parity" if check == "full" else check
            cases += [(f"{group}.{report.precision}", f"prompt_{n}", report.failure(p), near_tie_note(raw))
                      for n, (p, raw) in enumerate(zip(report.prompts, rec["prompts"]))]
    return cases


def write_junit(path: str | Path, result: dict) -> None:
    """Write :func:`junit_cases` of a ``run_checks`` result to ``path`` as one JUnit XML test suite."""
    cases = junit_cases(result)
    suite = ET.Element("testsuite", name="medusa-export verify", tests=str(len(cases)),
                       failures=str(sum(fail is not None for _, _, fail, _ in cases)))
    for classname, name, fail, note in cases:
        case = ET.SubElement(suite, "testcase", classname=classname, name=name)
        if note:  # properties first, system-out after a failure (the order JUnit's schema gives)
            ET.SubElement(ET.SubElement(case, "properties"), "property", name="near_tie", value=note)
        if fail:
            ET.SubElement(case, "failure", message=fail)
        if note:
            ET.SubElement(case, "system-out").text = note
    ET.ElementTree(suite).write(str(path), encoding="utf-8", xml_declaration=True)
