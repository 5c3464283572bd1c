"""`--prompt-cache-tail N` on serve / generate / chat: offered, carried into the engine's config (with a remote stage
too, where it asks for checkpoints), bad values refused as usage errors naming the flag. (The daemon saving the point:
tests/test_stratactl.py; over a worker: tests/test_remote_mid_prompt.py.)"""
from __future__ import annotations

import pytest

from strata.cli.engine_flags import engine_config
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
@pytest.mark.parametrize("flag", ["--prompt-cache-tail", "--prompt-cache-every"])
def test_taken_with_a_remote_stage_where_it_asks_for_checkpoints(cmd, flag):
    # engine_config is the check serve / generate / chat run before loading anything; over a worker --prompt-cache
    # defaults to 0 (no checkpoint message) unless a mid-prompt cut point asks for checkpoints
    remote = ["--remote-stage", "127.0.0.1:9", "--layer-split", "10", "--device", "cpu"]
    cfg = engine_config(build_parser().parse_args([cmd, flag, "8", *remote]))
    assert (cfg.checkpoints.tail, cfg.checkpoints.every) == ((8, 0) if flag.endswith("tail") else (0, 8))
    assert cfg.prompt_cache() == 6
    assert engine_config(build_parser().parse_args([cmd, *remote])).prompt_cache() == 0
    explicit = build_parser().parse_args([cmd, flag, "8", "--prompt-cache", "2", *remote])
    assert engine_config(explicit).prompt_cache() == 2


def test_engine_config_carries_the_tail():
    args = build_parser().parse_args(["generate", "--prompt-cache-tail", "32", "--device", "cpu"])
    assert engine_config(args).checkpoints.tail == 32
