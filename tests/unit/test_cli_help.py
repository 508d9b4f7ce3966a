"""The command's help (cosyvoice/cli/): each subcommand's ``--help`` says what it is for
and shows its own arguments, not the 90 server settings; ``--help-settings`` lists those,
and each still works as a flag."""

from __future__ import annotations

import dataclasses

import pytest

from cosyvoice import cli
from cosyvoice.settings import Settings

pytestmark = [pytest.mark.unit, pytest.mark.fast]

COMMANDS = ["serve", "gateway", "worker", "transcribe", "model", "token", "key", "usage"]


def help_of(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(list(argv))
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", COMMANDS)
def test_a_commands_help_is_its_purpose_and_its_own_arguments(capsys, command):
    text = help_of(capsys, command, "--help")
    usage, purpose, *rest = text.split("\n\n")
    assert usage.startswith(f"usage: cosyvoice {command}")
    assert not purpose.startswith(("options", "positional", " ")), purpose
    own = "\n\n".join(rest).split("Every server setting")[0]
    assert "--redis-url" not in usage + own and "--engine" not in usage + own
    assert len(text.splitlines()) < 80  # transcribe, the longest, has 20 arguments


def test_key_help_shows_its_name_argument_first_and_no_settings(capsys):
    text = help_of(capsys, "key", "--help")
    assert "print a new API key named NAME" in text
    assert "whose key it is" in text
    assert "--api-keys-file" not in text and "--help-settings" in text


def test_help_settings_lists_every_setting_with_its_variable_and_default(capsys):
    text = help_of(capsys, "serve", "--help-settings")
    for f in dataclasses.fields(Settings):
        assert "--" + f.name.replace("_", "-") in text
        assert "COSYVOICE_" + f.name.upper() in text
    assert "COSYVOICE_PORT (default: 5000)" in text


def test_settings_are_still_flags_of_the_commands_that_take_them():
    args = cli.build_parser().parse_args(["key", "team-a", "--api-keys-file", "/tmp/k",
                                          "--port", "5001"])
    assert args.name == "team-a" and args.api_keys_file == "/tmp/k" and args.port == 5001
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["transcribe", "x.wav", "--port", "5001"])
