"""progress: throttled plain lines off a terminal, nothing when disabled."""

from __future__ import annotations

from dflash_prep.progress import progress


def test_plain_lines_when_not_a_terminal(capsys):
    with progress("pack", total=4, unit="epochs", every_s=0) as p:
        for _ in range(4):
            p.advance()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("pack: 1/4 epochs (25%)") and "left" in err[0]
    assert err[3].startswith("pack: 4/4 epochs (100%)") and err[-1].startswith("pack: 4 epochs done in ")


def test_throttled_and_disabled(capsys):
    with progress("x", total=1000, every_s=3600) as p:
        for _ in range(1000):
            p.advance()
    assert len(capsys.readouterr().err.splitlines()) == 1       # only the final line
    with progress("x", total=3, enabled=False) as p:
        p.advance(3)
    assert capsys.readouterr().err == ""
