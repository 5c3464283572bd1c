"""The expert tier's flags on the command line (CPU): `strata serve`, `strata generate` and `strata worker` refuse a
bad value, or the tier without a GPU device, with one usage line naming the flag (exit 2), before loading anything."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "strata.cli.main", *args], capture_output=True, text=True, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)


@pytest.mark.parametrize("cmd", [["serve", "--socket", "/nonexistent/s.sock"], ["generate", "-p", "hi"],
                                 ["worker", "--listen", "127.0.0.1:0"]])
@pytest.mark.parametrize("flags,says", [
    (["--moe-vram-mib", "lots"], "--moe-vram-mib must be 'auto' or a whole number of MiB, got 'lots'"),
    (["--moe-vram-mib", "64", "--pcie-frac", "1.5"], "--pcie-frac must be in [0, 1] (0: no adaptation), got 1.5"),
    (["--moe-vram-mib", "auto"], "--moe-vram-mib needs --device cuda"),
    (["--adapt-every", "-1"], "--adapt-every"),
])
def test_bad_tier_flags_are_one_usage_line(cmd, flags, says):
    r = _run(*cmd, "--device", "cpu", *flags)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert says in lines[-1] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("flags", [["--adapt-every", "0"], ["--pcie-frac", "0"], ["--adapt-swaps", "0"],
                                   ["--pcie-frac", "0", "--adapt-every", "0", "--adapt-swaps", "0"]])
@pytest.mark.parametrize("cmd", [["serve"], ["generate"], ["chat"], ["worker"]])
def test_each_off_spelling_means_no_adaptation(cmd, flags):
    """The three "off" spellings parse (serve / generate / chat / worker) and give --adapt-swaps 0's tier: rounds
    that only fill free slots, no resident expert replaced; the help text says so."""
    from strata.cli.main import build_parser
    from strata.engine.config import MoeTierConfig

    args = build_parser().parse_args([*cmd, "--moe-vram-mib", "64", *flags])
    tier = MoeTierConfig(vram_mib=args.moe_vram_mib, adapt_every=args.adapt_every, adapt_swaps=args.adapt_swaps,
                         pcie_frac=args.pcie_frac)
    assert tier.problem() is None and not tier.adapts
    swaps0 = MoeTierConfig(vram_mib="64", adapt_swaps=0).settings()
    assert tier.settings() == swaps0 and swaps0.swaps == 0 and swaps0.every >= 1 and swaps0.pcie_frac > 0
    assert MoeTierConfig(vram_mib="64").adapts


def test_help_names_the_off_spellings(capsys):
    from strata.cli.main import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--adapt-every TOKENS", "--adapt-swaps N", "--pcie-frac F"):
        assert flag in text
    assert text.count("0 = no adaptation") == 3, text
