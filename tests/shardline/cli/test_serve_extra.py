"""shardline/cli/serve_extra.py: the commands that run the services say what to install where they are absent."""

from __future__ import annotations

import importlib.metadata

import pytest

from shardline.cli import main as cli_main
from shardline.cli import serve_extra


def test_this_checkout_has_every_serve_requirement():
    assert serve_extra.missing_serve_requirements() == []


def test_a_missing_serve_requirement_is_named_and_the_fix_given(monkeypatch, capsys):
    requirements = [
        "grpcio>=1.66",
        'torch-that-is-not-installed>=2.13; extra == "serve"',
        'pytest>=8; extra == "test"',
        'grpcio-reflection>=1.66; extra == "serve"',
    ]
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: requirements)
    assert serve_extra.missing_serve_requirements() == ["torch-that-is-not-installed"]
    with pytest.raises(serve_extra.ServeExtraMissing, match=r"shardline up runs .*pip install 'shardline\[serve\]'"):
        serve_extra.require_serve("up")
    assert cli_main.main(["serve", "gateway"]) == 2
    err = capsys.readouterr().err
    assert "shardline serve gateway runs Shardline's services" in err and "torch-that-is-not-installed" in err


def test_an_uninstalled_checkout_counts_as_complete(monkeypatch):
    def not_installed(name: str) -> list[str]:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", not_installed)
    assert serve_extra.missing_serve_requirements() == []
