"""``gpupool run``'s GNU parallel features: replacement strings, ``:::``, ``-0``, streamed
output (``--line-buffer``, ``-u``) and ``--halt``, on real commands on the simulated host."""

from __future__ import annotations

import select
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest

from gpupool._commands.cli import EXIT_USAGE, main
from gpupool._commands.run import build_command
from gpupool._commands.run_output import Halt, parse_halt
from gpupool.testing import SimulatedDevice, SimulatedHost

GPUPOOL_RUN = (sys.executable, "-m", "gpupool", "run", "--task-peak", "1GiB")

#: How long a test waits for something it controls before it fails (never a sleep).
DEADLINE_S = 120.0

#: A command's wait for the test's gate file: a minute, then it goes on (a test that
#: never opens the gate still ends).
GATE_WAIT = "for i in $(seq 600); do [ -e {gate} ] && break; sleep 0.1; done"


def _host() -> SimulatedHost:
    return SimulatedHost([SimulatedDevice("40GiB")], cpus=8, host_ram="64GiB")


def _run(*argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [*GPUPOOL_RUN, *argv], input=stdin, capture_output=True, timeout=300, check=False
    )


def _wait_gate(gate: Path) -> str:
    return GATE_WAIT.format(gate=shlex.quote(str(gate)))


# -- the command for an input ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # {}  {.}  {/}  {//}  {/.}
        (
            "sub/dir/foo.tar.gz",
            ["sub/dir/foo.tar.gz", "sub/dir/foo.tar", "foo.tar.gz", "sub/dir", "foo.tar"],
        ),
        ("foo.jpg", ["foo.jpg", "foo", "foo.jpg", ".", "foo"]),
        ("dir.d/file", ["dir.d/file", "dir.d/file", "file", "dir.d", "file"]),
        ("/top", ["/top", "/top", "top", "/", "top"]),
        ("a b/c d.txt", ["a b/c d.txt", "a b/c d", "c d.txt", "a b", "c d"]),
    ],
)
def test_replacement_strings_mean_what_gnu_parallels_do(line: str, expected: list[str]) -> None:
    """{.} drops a last extension (never past a /), {/} is the base name, {//} the directory
    (. without one), {/.} the base name without extension, {#} the command's number; each
    is shell-quoted."""
    command = build_command("f {} {.} {/} {//} {/.} {#}", line, 7)
    assert shlex.split(command) == ["f", *expected, "7"]


def test_a_replacement_string_other_than_braces_keeps_the_line_from_being_appended() -> None:
    """The line is appended only where the command holds no replacement string at all."""
    assert build_command("echo {#}", "x", 3) == "echo 3"
    assert build_command("echo", "x y", 3) == "echo 'x y'"


def test_arguments_after_three_colons_are_the_input() -> None:
    """``-- echo {/} {//} {#} ::: a/b.txt c`` runs one command per argument, in order."""
    with _host():
        done = _run("--", "echo", "{/}", "{//}", "{.}", "{#}", ":::", "a/b.txt", "c", "d e")
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().splitlines() == [
        "b.txt a a/b 1",
        "c . c 2",
        "d e . d e 3",
    ]


def test_null_separated_input_keeps_newlines_in_an_item() -> None:
    """``-0``: items end with NUL bytes, so a newline is part of an item (find -print0)."""
    with _host():
        done = _run("-0", "--", "printf", "'<%s>'", stdin=b"a b\0c\nd\0last")
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"<a b><c\nd><last>"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--", "echo", ":::"], "::: with no argument after it"),
        (["--", "echo", ":::", "a", ":::", "b"], "one ::: input source only"),
        (["-a", "x.txt", "--", "echo", ":::", "a"], "::: and --input 'x.txt' both give the input"),
        (["--halt", "sometimes", "--", "echo"], "--halt 'sometimes': give WHEN,WHY=N"),
        (["--halt", "now,fail=10%", "--", "echo"], "a percentage needs the number of commands"),
        (["--halt", "soon,fail=0", "--", "echo"], "N must be a whole number of commands"),
        (["--line-buffer", "-u", "--", "echo"], "not allowed with argument"),
    ],
)
def test_bad_parallel_options_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """Each says what was wrong and what to give instead; exit 2."""
    with pytest.raises(SystemExit) as info:
        main(["run", *argv])
    assert info.value.code == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_halt_takes_gnu_parallels_spellings() -> None:
    """The WHEN,WHY=N form and the older numbers, as GNU parallel reads them."""
    assert parse_halt("never") is None and parse_halt("0") is None
    assert parse_halt("now,fail=1") == Halt(when="now", why="fail", count=1)
    assert parse_halt("soon,success=3") == Halt(when="soon", why="success", count=3)
    assert parse_halt("now,done=2") == Halt(when="now", why="done", count=2)
    assert parse_halt("1") == Halt(when="soon", why="fail", count=1)
    assert parse_halt("2") == Halt(when="now", why="fail", count=1)
    assert parse_halt("-2") == Halt(when="now", why="success", count=1)


# -- streamed output -----------------------------------------------------------------------------


def _read_until(stream: IO[bytes], wanted: bytes) -> bytes:
    """What ``stream`` gives until ``wanted`` is in it (a failure after DEADLINE_S)."""
    seen = b""
    deadline = time.monotonic() + DEADLINE_S
    while wanted not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"never saw {wanted!r}; saw {seen!r}"
        readable, _, _ = select.select([stream], [], [], left)
        if readable:
            chunk = stream.read1(4096)  # type: ignore[attr-defined]
            assert chunk, f"the output ended before {wanted!r}; saw {seen!r}"
            seen += chunk
    return seen


@pytest.mark.parametrize(("flag", "first"), [("--line-buffer", b"start 1\n"), ("-u", b"part 1")])
def test_output_is_printed_while_the_command_runs(tmp_path: Path, flag: str, first: bytes) -> None:
    """An hour-long command is not silent for an hour: with --line-buffer its complete
    lines, and with -u even a line not yet ended, are printed while it still runs (the
    command waits for a file the test makes only once it has read them)."""
    gate = tmp_path / "go"
    command = f'echo start {{}}; printf "part {{}}"; {_wait_gate(gate)}; echo " end {{}}"'
    with _host():
        proc = subprocess.Popen(
            [*GPUPOOL_RUN, flag, "--", command, ":::", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        assert proc.stdout is not None
        try:
            seen = _read_until(proc.stdout, first)
            gate.touch()
            out, err = proc.communicate(timeout=DEADLINE_S)
        finally:
            gate.touch()
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err
    assert seen + out == b"start 1\npart 1 end 1\n"
    if flag == "--line-buffer":
        assert b"part" not in seen  # a line is printed only once it is whole


def test_streamed_output_of_a_failed_command_comes_before_its_failure_line() -> None:
    """With --line-buffer a failed command's last line (no newline) is printed when it
    ends, then its failure, with its line; the exit status counts it."""
    with _host():
        done = _run("--line-buffer", "--", "printf 'tail {}'; exit 4", ":::", "x")
    assert done.returncode == 1
    assert done.stdout == b"tail x"
    assert b"gpupool run: line 1 ('x'): exit status 4: printf 'tail x'; exit 4" in done.stderr


# -- --halt ---------------------------------------------------------------------------------


def test_halt_now_stops_the_running_commands_at_the_first_failure(tmp_path: Path) -> None:
    """``--halt now,fail=1``: the second command fails at once; the others, waiting for a
    gate that never opens, are stopped (none prints "late"), none after them starts, and
    the exit status is the failed command's own."""
    gate = tmp_path / "never"
    command = f"[ {{}} = 2 ] && exit 7; {_wait_gate(gate)}; echo late {{}}"
    with _host():
        done = _run(
            "--max-workers",
            "3",
            "--halt",
            "now,fail=1",
            "--",
            command,
            ":::",
            *map(str, range(1, 9)),
        )
    assert done.returncode == 7, done.stderr
    assert b"late" not in done.stdout
    assert b"--halt now,fail=1 reached at line 2: starting no more commands" in done.stderr
    assert b"line 2 ('2'): exit status 7" in done.stderr


def test_halt_soon_lets_the_running_commands_finish(tmp_path: Path) -> None:
    """``--halt soon,fail=1``: once a command failed, no more start; those running finish
    (the test opens their gate only after gpupool run said it halts), and the exit status
    is the failed command's."""
    gate = tmp_path / "go"
    inputs = [":::", *map(str, range(1, 21))]
    command = f"[ {{}} = 2 ] && exit 5; {_wait_gate(gate)}; echo done {{}}"
    with _host():
        proc = subprocess.Popen(
            [*GPUPOOL_RUN, "--max-workers", "2", "--halt", "soon,fail=1", "--", command, *inputs],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        assert proc.stderr is not None
        try:
            said = _read_until(proc.stderr, b"--halt soon,fail=1 reached at line 2")
            gate.touch()
            out, err = proc.communicate(timeout=DEADLINE_S)
        finally:
            gate.touch()
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 5, said + err
    finished = out.decode().splitlines()
    assert "done 1" in finished  # running when the halt came: it finished
    # At most the two the width let run beside the failure started; not the 20.
    assert len(finished) <= 2, finished


def test_halt_on_success_exits_0_at_the_first_success(tmp_path: Path) -> None:
    """``--halt now,success=1``: the first command to succeed ends the run with status 0."""
    gate = tmp_path / "never"
    command = f"[ {{}} = 3 ] && exit 0; {_wait_gate(gate)}; exit 1"
    with _host():
        done = _run(
            "--max-workers", "4", "--halt", "now,success=1", "--", command, ":::", "1", "2", "3"
        )
    assert done.returncode == 0, done.stderr
    assert b"--halt now,success=1 reached at line 3" in done.stderr
