"""``gpupool run``: shell commands per input line, as tasks on the simulated host."""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpupool._commands.cli import EXIT_INTERRUPTED, EXIT_USAGE, main
from gpupool._commands.run import (
    COMMAND_GRACE_S,
    MAX_FAILED_STATUS,
    build_command,
    default_key,
    exit_status,
)
from gpupool._core.events import TASK_KEY_CHARS
from gpupool._core.units import GiB
from gpupool._pool.executor import INTERRUPT_GRACE_S
from gpupool.testing import SimulatedDevice, SimulatedHost
from support import wait_for

PYTHON = shlex.quote(sys.executable)

GPUPOOL_RUN = (sys.executable, "-m", "gpupool", "run")

#: How long a test waits for a condition it controls before it fails (never a sleep).
DEADLINE_S = 120.0


def _gpupool_run(
    *argv: str, stdin: str = "", cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPUPOOL_RUN, *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def _host(total: str = "40GiB") -> SimulatedHost:
    return SimulatedHost([SimulatedDevice(total)], cpus=8, host_ram="64GiB")


# -- the command for a line ----------------------------------------------------------------


def test_placeholder_is_the_shell_quoted_line() -> None:
    """Every ``{}`` becomes the quoted line; without ``{}`` the line is the last word."""
    assert build_command("echo {} {}", "a b") == "echo 'a b' 'a b'"
    assert build_command("wc -c", "it's") == "wc -c 'it'\"'\"'s'"
    assert build_command("echo {}", "") == "echo ''"


def test_exit_status_counts_failures_as_gnu_parallel() -> None:
    """0 when none failed, the count up to 100, 101 beyond."""
    assert [exit_status(n) for n in (0, 1, 2, 100, 101, 5000)] == [0, 1, 2, 100, 101, 101]
    assert MAX_FAILED_STATUS == 101


def test_command_grace_ends_before_the_pools_grace() -> None:
    """A stopping worker SIGKILLs its command's group before the pool SIGKILLs the worker."""
    assert COMMAND_GRACE_S < INTERRUPT_GRACE_S


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run"], "no command given: put it after --"),
        (["run", "--"], "no command given: put it after --"),
        (["run", "--", " "], "no command given"),
        (["run", "--bogus", "--", "echo"], "unrecognized arguments: --bogus"),
        (["run", "--task-peak", "6 gigs", "--", "echo"], "--task-peak='6 gigs' is not a byte size"),
        (["run", "--task-peak", "0", "--", "echo"], "--task-peak='0' is zero"),
        (["run", "--max-workers", "0", "--", "echo"], "--max-workers='0' must be at least 1"),
        (["run", "--reserve", "lots", "--", "echo"], "--reserve='lots' is not a byte size"),
        (["run", "--key", "", "--", "echo"], "--key '' is empty"),
        (["run", "--key", "k" * 1001, "--", "echo"], "--key has 1001 characters: a task key"),
    ],
)
def test_bad_input_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    """A bad command line exits 2 with a message naming the value."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_USAGE
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_an_unreadable_input_file_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str
) -> None:
    """``--input`` naming no readable file exits 2, naming the file and the fix."""
    path = tmp_path / "missing.txt" if kind == "missing" else tmp_path
    with pytest.raises(SystemExit) as info:
        main(["run", "--input", str(path), "--", "echo", "{}"])
    assert info.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"--input {str(path)!r} cannot be read" in err
    assert "pass a readable file of one input per line" in err


def test_a_reserve_the_pool_refuses_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A reserve not smaller than the card exits 2 with the pool's own reason."""
    lines = tmp_path / "lines.txt"
    lines.write_text("a\n")
    with _host("40GiB"), pytest.raises(SystemExit) as info:
        main(["run", "-a", str(lines), "--reserve", "40GiB", "--", "echo", "{}"])
    assert info.value.code == EXIT_USAGE
    assert "is not smaller than card 0's" in capsys.readouterr().err


# -- commands as tasks ---------------------------------------------------------------------

#: Line n: an odd n waits until line n+1 has ended, so completion order is 2 1 4 3 ...
_WAIT_FOR_NEXT = """
import pathlib, sys, time
n, d = int(sys.argv[1]), pathlib.Path(sys.argv[2])
if n % 2:
    deadline = time.monotonic() + 60
    while not (d / f"{n + 1}.done").exists():
        if time.monotonic() > deadline:
            sys.exit(f"line {n}: line {n + 1} never ended beside it")
        time.sleep(0.01)
print("out", n)
print("err", n, file=sys.stderr)
with open(d / "ended.txt", "a") as ended:
    ended.write(f"{n}\\n")
(d / f"{n}.done").touch()
"""


def test_a_command_longer_than_a_key_runs_under_a_bounded_key_of_its_own(tmp_path: Path) -> None:
    """A command template longer than a task key may be runs, its key its start and a digest
    of the whole (two such templates that differ only at the end keep keys of their own)."""
    tail = "x" * 1500
    assert len(default_key(f"echo {{}} # {tail}a")) <= TASK_KEY_CHARS
    assert default_key(f"echo {{}} # {tail}a") != default_key(f"echo {{}} # {tail}b")
    assert default_key("echo {}") == "echo {}"
    log = tmp_path / "run.jsonl"
    with _host():
        done = _gpupool_run(
            "--task-peak", "1GiB", "--log", str(log), "--", f"echo {{}} # {tail}", stdin="7\n"
        )
    assert (done.returncode, done.stdout) == (0, "7\n"), done.stderr
    keys = {json.loads(line).get("key") for line in log.read_text().splitlines()}
    assert default_key(f"echo {{}} # {tail}") in keys


def test_output_is_in_input_order(tmp_path: Path) -> None:
    """Commands that end out of order print in input order, stdout and stderr alike."""
    script = tmp_path / "wait_for_next.py"
    script.write_text(_WAIT_FOR_NEXT)
    with _host():
        done = _gpupool_run(
            "--task-peak",
            "1GiB",
            "--max-workers",
            "2",
            "--",
            f"{PYTHON} {shlex.quote(str(script))} {{}} {shlex.quote(str(tmp_path))}",
            stdin="1\n2\n3\n4\n",
        )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ended.txt").read_text().split() == ["2", "1", "4", "3"]
    assert done.stdout.splitlines() == ["out 1", "out 2", "out 3", "out 4"]
    errs = [line for line in done.stderr.splitlines() if line.startswith("err ")]
    assert errs == ["err 1", "err 2", "err 3", "err 4"]


def test_failed_commands_set_the_status_and_are_named(tmp_path: Path) -> None:
    """Three failing commands (an exit status, a signal, a killed worker): status 3, each
    named on stderr with its line; the other commands' results kept."""
    lines = tmp_path / "lines.txt"
    lines.write_text("1\n2\n3\n4\n5\n6\n")
    with _host():
        done = _gpupool_run(
            "--task-peak",
            "1GiB",
            "-a",
            str(lines),
            "--",
            "echo out {}; case {} in 2) exit 3;; 4) kill -9 $$;; 5) kill -9 $PPID; sleep 9;; esac",
        )
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == [f"out {n}" for n in range(1, 7)]
    assert "gpupool run: line 2 ('2'): exit status 3: echo out 2; case 2 in" in done.stderr
    assert "gpupool run: line 4 ('4'): killed by SIGKILL: echo out 4;" in done.stderr
    assert "gpupool run: line 5 ('5'): could not run (WorkerLostError: " in done.stderr
    for n in (1, 3, 6):
        assert f"line {n} " not in done.stderr


def test_no_input_runs_nothing() -> None:
    """Empty input: exit 0, no output."""
    with _host():
        done = _gpupool_run("--task-peak", "1GiB", "--", "echo", "ran")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_undecodable_bytes_reach_the_command_unchanged(tmp_path: Path) -> None:
    """A line that is not UTF-8 is passed on byte for byte."""
    with _host():
        done = subprocess.run(
            [*GPUPOOL_RUN, "--task-peak", "1GiB", "--", "printf", "'%s\\n'"],
            input=b"caf\xe9 \xff\n",
            capture_output=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"caf\xe9 \xff\n"


def test_a_line_with_spaces_and_quotes_reaches_the_command_whole(tmp_path: Path) -> None:
    """``{}`` is the line, quoted: spaces, quotes and shell syntax arrive as one argument."""
    lines = ["ckpt a.pt", 'it\'s "quoted"', "$HOME `id` ; echo no", "tab\there", ""]
    with _host():
        done = _gpupool_run(
            "--task-peak", "1GiB", "--", "printf", "'<%s>\\n'", stdin="\n".join(lines) + "\n"
        )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"<{line}>" for line in lines]


def test_commands_start_and_print_as_the_input_arrives(tmp_path: Path) -> None:
    """The first line's command runs, and its output is printed, before the input ends."""
    with _host():
        proc = subprocess.Popen(
            [*GPUPOOL_RUN, "--task-peak", "1GiB", "--", "echo"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdin is not None
        assert proc.stdout is not None
        try:
            proc.stdin.write("first\n")
            proc.stdin.flush()
            readable, _, _ = select.select([proc.stdout], [], [], DEADLINE_S)
            assert readable, "no output while the input stayed open"
            first = proc.stdout.readline()
            out, err = proc.communicate("second\n", timeout=DEADLINE_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err
    assert [first.strip(), *out.splitlines()] == ["first", "second"]


def test_a_closed_output_is_quiet(tmp_path: Path) -> None:
    """``gpupool run ... | head -1``: no traceback, exit 141, and no command after it starts."""
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"{n}\n" for n in range(1, 201)))
    command = f"echo {{}}; echo {{}} >> {shlex.quote(str(tmp_path / 'ran.txt'))}"
    argv = ["--task-peak", "1GiB", "--max-workers", "1", "-a", str(lines), "--", command]
    with _host():
        proc = subprocess.Popen(
            [*GPUPOOL_RUN, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"1\n"
        proc.stdout.close()
        _, err = proc.communicate(timeout=DEADLINE_S)
    assert b"Traceback" not in err, err.decode()
    assert proc.returncode == 141
    assert len((tmp_path / "ran.txt").read_text().split()) < 200


#: Holds 5 GiB on the simulated card (5.3 GiB with its context) while it runs.
_HOLD = """
import sys
import gpupool.testing as gt
with gt.hold("5GiB"):
    print("held", sys.argv[1])
"""


def test_memory_sets_the_width(tmp_path: Path) -> None:
    """task peak 6 GiB, a 14 GiB card: at most 2 commands at once, with memory the limit."""
    script = tmp_path / "hold.py"
    script.write_text(_HOLD)
    log = tmp_path / "run.jsonl"
    with _host("14GiB") as host:
        done = _gpupool_run(
            "--task-peak",
            "6GiB",
            "--max-workers",
            "4",
            "--log",
            str(log),
            "--",
            PYTHON,
            shlex.quote(str(script)),
            stdin="".join(f"{n}\n" for n in range(1, 6)),
        )
        oom = host.out_of_memory_events
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"held {n}" for n in range(1, 6)]
    # Three at once would have overflowed the card (3 x 5.3 GiB > 14 GiB).
    assert oom == []
    records = [json.loads(line) for line in log.read_text().splitlines()]
    decided = [r for r in records if r.get("device") == 0 and r.get("limit") is not None]
    assert decided, records
    assert max(r["width_after"] for r in decided) == 2
    assert all(r["limit"] == "memory" for r in decided)
    # Priced by the key of the template, at a peak measured from the command's tree
    # (the shell's child python holds the bytes).
    template = f"{PYTHON} {shlex.quote(str(script))}"
    measured = [r for r in records if r["event"] == "measured"]
    assert measured, records
    assert {r["key"] for r in measured} == {template}
    assert all(r["peak_bytes"] >= 5 * GiB for r in measured)


# -- Ctrl-C --------------------------------------------------------------------------------


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize(
    ("sig", "source"),
    [(signal.SIGINT, "file"), (signal.SIGTERM, "file"), (signal.SIGINT, "stdin")],
    ids=["ctrl-c", "sigterm", "ctrl-c-stdin-open"],
)
def test_ctrl_c_stops_every_command_and_exits_130(
    tmp_path: Path, sig: signal.Signals, source: str
) -> None:
    """SIGINT (or SIGTERM) while two commands block: exit 130, nothing started after, no
    process of theirs left (one ignores SIGTERM and is orphaned: only its group reaches it);
    also while standard input stays open, and whatever GPUPOOL_ON_INTERRUPT says."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)  # never opened for writing: a reader blocks until it is killed
    where = shlex.quote(str(tmp_path))
    command = (
        f"(trap '' TERM; exec sleep 600) & echo $! > {where}/{{}}.child; "
        f"echo $$ > {where}/{{}}.tmp && mv {where}/{{}}.tmp {where}/{{}}.pid; "
        f"exec cat {shlex.quote(str(gate))}"
    )
    text = "".join(f"{n}\n" for n in range(1, 7))
    lines = tmp_path / "lines.txt"
    lines.write_text(text)
    argv = ["--task-peak", "1GiB", "--max-workers", "2", "--", command]
    if source == "file":
        argv[:0] = ["-a", str(lines)]
    with _host():
        proc = subprocess.Popen(
            [*GPUPOOL_RUN, *argv],
            stdin=subprocess.DEVNULL if source == "file" else subprocess.PIPE,
            # A pool's own default says wait for the running tasks; gpupool run does not.
            env={**os.environ, "GPUPOOL_ON_INTERRUPT": "wait"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        if proc.stdin is not None:  # left open: gpupool reads on while it is stopped
            proc.stdin.write(text)
            proc.stdin.flush()
        try:
            wait_for(
                lambda: len(list(tmp_path.glob("*.pid"))) == 2,
                timeout_s=DEADLINE_S,
                what="two commands running",
            )
            os.kill(proc.pid, sig)
            proc.wait(timeout=DEADLINE_S)
            assert proc.stderr is not None
            err = proc.stderr.read()
            assert proc.returncode == EXIT_INTERRUPTED, err
            assert err.strip().splitlines()[-1] == "gpupool: interrupted"
            assert "Traceback" not in err
            pids = _recorded_pids(tmp_path)
            assert len(pids) == 4, pids  # two commands started, each with its child; no third
            # Signalled before gpupool exited; a killed process may take a moment to go.
            wait_for(
                lambda: not any(_running(pid) for pid in pids),
                timeout_s=DEADLINE_S,
                what=f"{pids} to be gone",
            )
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            for pid in _recorded_pids(tmp_path):  # a failed run's: not for the next test
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def _recorded_pids(directory: Path) -> list[int]:
    pids = []
    for path in sorted(directory.glob("*.pid")) + sorted(directory.glob("*.child")):
        text = path.read_text().strip()
        if text:
            pids.append(int(text))
    return pids


def test_a_commands_background_processes_end_with_it(tmp_path: Path) -> None:
    """A command that leaves processes running (``cmd &``, one ignoring SIGTERM) does not
    leave them behind: they end when its shell does, and the status is the shell's."""
    where = shlex.quote(str(tmp_path))
    command = (
        f"sleep 600 & echo $! > {where}/{{}}.pid; "
        f"(trap '' TERM; exec sleep 600) & echo $! > {where}/{{}}.child; echo started {{}}"
    )
    with _host():
        done = _gpupool_run("--task-peak", "1GiB", "--", command, stdin="1\n2\n")
    pids = _recorded_pids(tmp_path)
    try:
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == ["started 1", "started 2"]
        assert len(pids) == 4, pids
        wait_for(
            lambda: not any(_running(pid) for pid in pids),
            timeout_s=DEADLINE_S,
            what=f"{pids} to be gone",
        )
    finally:
        for pid in pids:  # a failed run's: not for the next test
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_line_too_long_for_a_command_fails_with_a_short_message() -> None:
    """A line longer than the system takes as one argument: that command fails, named on one
    short line (the line and command cut), and the next line's command runs."""
    long_line = "x" * 300_000
    with _host():
        done = _gpupool_run("--task-peak", "1GiB", "--", "echo", stdin=f"{long_line}\nshort\n")
    assert done.returncode == 1, done.stderr[:2000]
    assert done.stdout == "short\n"
    failures = [line for line in done.stderr.splitlines() if line.startswith("gpupool run:")]
    assert len(failures) == 1
    assert failures[0].startswith("gpupool run: line 1 ('xxx")
    assert "could not run (OSError: [Errno 7] Argument list too long" in failures[0]
    assert len(done.stderr) < 2000


# -- a command that runs the card out of memory -------------------------------------------

#: Wait (at most 60 s) until three commands have started, then hold 4.5 GiB until three
#: hold or one was refused: three at once do not fit a 12 GiB card, whatever the load. A
#: refused one fails as a framework's out-of-memory does: its error on stderr.
_HOLD_TOGETHER = """
import pathlib, sys, time
import gpupool.testing as gt
gate = pathlib.Path(sys.argv[2])

def wait_for(pattern):
    deadline = time.monotonic() + 60
    while len(list(gate.glob(pattern))) < 3 and time.monotonic() < deadline:
        if list(gate.glob("refused-*")):
            return
        time.sleep(0.01)

(gate / f"started-{sys.argv[1]}").touch()
wait_for("started-*")
try:
    with gt.hold("4.5GiB"):
        (gate / f"holding-{sys.argv[1]}").touch()
        wait_for("holding-*")
        print("held", sys.argv[1])
except gt.SimulatedOutOfMemory:
    (gate / f"refused-{sys.argv[1]}").touch()
    raise
"""


def test_a_command_that_runs_the_card_out_of_memory_is_retried(tmp_path: Path) -> None:
    """Six commands priced at 1 GiB that each hold 4.5 GiB, three at once on a 12 GiB card:
    those the card refused say so on stderr, are classified as out-of-memory from it (the
    record says how) and retried at a raised ask, and every command ends held."""
    script = tmp_path / "hold.py"
    script.write_text(_HOLD_TOGETHER)
    gate = tmp_path / "gate"
    gate.mkdir()
    log = tmp_path / "run.jsonl"
    with _host("12GiB") as host:
        done = _gpupool_run(
            "--task-peak",
            "1GiB",
            "--max-workers",
            "3",
            "--log",
            str(log),
            "--",
            PYTHON,
            shlex.quote(str(script)),
            "{}",
            shlex.quote(str(gate)),
            stdin="".join(f"{n}\n" for n in range(1, 7)),
        )
        refused = host.out_of_memory_events
    assert refused, "three commands of 4.5 GiB at once on a 12 GiB card: one was refused"
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == sorted(f"held {n}" for n in range(1, 7))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    ooms = [r for r in records if r["event"] == "out_of_memory"]
    assert ooms and all(r["oom_recognised"] == "command-output" for r in ooms)
    assert all(r["retry"] is True for r in ooms)


def test_a_command_that_exits_1_silently_after_a_refused_allocation_is_retried(
    tmp_path: Path,
) -> None:
    """Two commands priced at 1 GiB that each hold 3.5 GiB, together on a 6 GiB card: the one the
    card refused exits 1 and says nothing; it is classified as out-of-memory from the card's
    refusal (``card-full``), retried, and both commands end held (exit 0)."""
    import full_card_tasks

    script = tmp_path / "hold.py"
    script.write_text(full_card_tasks.pair_script())
    gate = tmp_path / "gate"
    gate.mkdir()
    log = tmp_path / "run.jsonl"
    with _host("6GiB") as host:
        done = _gpupool_run(
            "--task-peak",
            "1GiB",
            "--max-workers",
            "2",
            "--log",
            str(log),
            "--",
            PYTHON,
            shlex.quote(str(script)),
            "3.5GiB",
            shlex.quote(str(gate)),
            "{}",
            stdin="1\n2\n",
        )
        refused = host.out_of_memory_events
    assert refused, "two commands of 3.5 GiB at once on a 6 GiB card: one was refused"
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["held 1", "held 2"]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    ooms = [r for r in records if r["event"] == "out_of_memory"]
    assert ooms and all(r["oom_recognised"] == "card-full" for r in ooms)
    assert all(r["retry"] is True for r in ooms)
    assert "refused an allocation of 3.50 GiB" in ooms[0]["card_full_reason"]
