"""`--prompt-cache-tail N` on serve / generate / chat: offered, carried into the engine's config, bad values and a
remote stage refused as usage errors naming the flag. (The daemon saving the point: tests/test_stratactl.py.)"""
from __future__ import annotations

import pytest

from strata.cli.engine_flags import CliError, engine_config
from strata.cli.main import build_parser, main


def _cli(capsys, *args) -> tuple[int, str, str]:
    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("cmd", ["serve", "generate", "chat"])
def test_flag_is_offered_and_bad_values_name_it(capsys, cmd):
    rc, out, _ = _cli(capsys, cmd, "--help")
    assert rc == 0 and "--prompt-cache-tail N" in out
    rc, _, err = _cli(capsys, cmd, "--prompt-cache-tail", "-3")
    assert rc == 2 and err.strip().splitlines()[-1].endswith("argument --prompt-cache-tail: must be >= 0, got -3"), err


@pytest.mark.parametrize("cmd", ["serve", "generate", "chat"])
def test_refused_with_a_remote_stage(cmd):
    # engine_config is the check serve / generate / chat run before loading anything (a CliError is exit 2)
    args = build_parser().parse_args([cmd, "--prompt-cache-tail", "8", "--remote-stage", "127.0.0.1:9",
                                      "--layer-split", "10", "--device", "cpu"])
    with pytest.raises(CliError) as e:
        engine_config(args)
    assert e.value.exit_code == 2
    assert str(e.value) == ("mid-prompt checkpoints (--prompt-cache-tail) are not supported with a remote stage "
                            "(--remote-stage)")


def test_engine_config_carries_the_tail():
    args = build_parser().parse_args(["generate", "--prompt-cache-tail", "32", "--device", "cpu"])
    assert engine_config(args).checkpoints.tail == 32
