"""What the CLI tests read from a command's captured output."""

from __future__ import annotations


def one_line_error(capsys) -> str:
    """The one non-blank line a failed command wrote to stderr (asserts there is exactly one and
    no traceback)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]
