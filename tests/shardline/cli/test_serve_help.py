"""`shardline serve <service> --help` names the command a user typed."""

import pytest

from shardline.cli.main import main


@pytest.mark.parametrize("service", ["gateway", "tokenizer", "scheduler", "worker", "tracing"])
def test_serve_help_names_the_command(service, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", service, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: shardline serve {service} ")


def test_up_takes_its_model_from_shardline_model(monkeypatch):
    """The services would read SHARDLINE_MODEL anyway: `up` must say (and load) the same model."""
    from shardline.cli.main import build_parser

    monkeypatch.setenv("SHARDLINE_MODEL", "/models/x.gguf")
    assert build_parser().parse_args(["up"]).model == "/models/x.gguf"
    assert build_parser().parse_args(["up", "--model", "/m/y"]).model == "/m/y"
    monkeypatch.setenv("SHARDLINE_MODEL", "")
    assert build_parser().parse_args(["up"]).model is None
