"""`shardline serve <service> --help` names the command a user typed."""

import pytest

from shardline.cli.main import main


@pytest.mark.parametrize("service", ["gateway", "tokenizer", "scheduler", "worker", "tracing"])
def test_serve_help_names_the_command(service, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", service, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: shardline serve {service} ")
