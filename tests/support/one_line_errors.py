"""A command's bad input ends in one line on stderr, exit status 2, no traceback."""


def assert_one_line_error(returncode: int, stderr: str, *expected: str) -> None:
    assert returncode == 2, stderr
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0], stderr
    for text in expected:
        assert text in lines[0]
