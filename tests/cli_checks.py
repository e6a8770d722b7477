"""Shared assertion for the profiler CLI's bad-input contract."""

from moe_ffn.cli import main


def one_line_error(capsys, *argv: str) -> str:
    """Run `moe-ffn profile ARGV`; it must exit 2 with one stderr line and no traceback."""
    code = main(["profile", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    return err
