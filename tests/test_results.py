"""Every top-level result has the same interface (memkit/results.py), and its parts agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from result_cases import every_result, track_report

from memkit.results import Result


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_subclasses(sub)}
    return out


def test_every_result_class_is_covered_here():
    covered = {type(r) for r in every_result()}
    missing = {c for c in _subclasses(Result) if c.__module__.startswith("memkit.")} - covered
    assert not missing, f"add an instance of {sorted(c.__name__ for c in missing)} to this test"


@pytest.mark.parametrize("result", every_result(), ids=lambda r: type(r).__name__)
def test_the_five_methods_agree(result: Result, tmp_path: Path):
    data = result.to_dict()
    assert next(iter(data)) == "schema" and data["schema"] == type(result).SCHEMA
    assert data["schema"].startswith("memkit.") and data["schema"].endswith("/1")
    text = result.to_json()
    assert json.loads(text) == data  # JSON-ready: no tuples, nothing json.dumps converts
    assert json.loads(result.to_json(indent=None)) == data
    written = tmp_path / "result.json"
    assert result.to_json(written) == text and written.read_text() == text + "\n"

    fragment = result._repr_html_()
    body = result.html_body()
    assert body and body in fragment
    page = result.to_html()
    assert page.startswith("<!DOCTYPE html>") and fragment in page and "<script" not in page
    assert result.to_html(tmp_path / "result.html") == page
    assert (tmp_path / "result.html").read_text() == page

    assert str(result) and not str(result).startswith(type(result).__name__ + "(")
    short = repr(result)  # design.md: a short repr; the text is str(), the notebook the HTML
    assert short.startswith(type(result).__name__ + "(") and "\n" not in short, short
    assert len(short) <= 140 and short != str(result), short


def test_to_json_passes_its_options_to_to_dict():
    full, lean = track_report().to_dict(), track_report().to_dict(timeline=False)
    assert full["devices"][0]["timeline"] and "timeline" not in lean["devices"][0]
    assert json.loads(track_report().to_json(timeline=False)) == lean
    assert "\n" not in track_report().to_json(indent=None)


def test_a_size_that_ran_out_in_the_allocator_model_is_a_lower_bound() -> None:
    """The estimate's peaks of a step that ran out are where it failed: the table says '>='
    and the does-not-fit headline 'more than' (they read as the step's whole need)."""
    import dataclasses

    from result_cases import estimate_does_not_fit

    from memkit.render.estimate import estimate_headline, estimate_text

    est = estimate_does_not_fit(128)
    ran_out = dataclasses.replace(est, trials=(dataclasses.replace(est.trials[0], ran_out=True),))
    assert "needs 31.00 GiB reserved" in estimate_headline(est)
    assert "needs more than 31.00 GiB reserved" in estimate_headline(ran_out)
    assert ">= 31.00 GiB" in estimate_text(ran_out) and ">=" not in estimate_text(est)
