"""Run an operator's pre-start program (reset a card, load a bitstream) for the kubelet's
PreStartContainer, safely.

No shell: the configured argv is executed as is, so a device id or address can never be
interpreted as shell syntax. Devices are described in environment variables, not appended to
argv, so a stock tool (``xbutil reset --force``) sees exactly the arguments the operator wrote.
The program runs in its own session and, on timeout, its whole process group is killed: a
shell script's ``sleep`` must not outlive it. Output goes to a temporary file rather than a
pipe, so a grandchild that keeps the pipe open cannot stall us past the deadline, and only its
tail is kept for the error message.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from typing import IO, Mapping, Sequence

log = logging.getLogger(__name__)

_TAIL_BYTES = 2048
_REAP_S = 2.0


class PreStartError(RuntimeError):
    """The pre-start program could not run, failed or overran; the message says which."""


def run_program(argv: Sequence[str], env: Mapping[str, str], timeout_s: float, what: str) -> None:
    """Run ``argv`` with ``env`` added to ours; raise PreStartError unless it exits 0 in time."""
    program = argv[0]
    environ = dict(os.environ)
    environ.update(env)
    import tempfile  # random, shutil and compressors: only when a program runs

    with tempfile.TemporaryFile() as output:
        try:
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                env=environ,
                cwd="/",
                close_fds=True,
                start_new_session=True,
            )
        except FileNotFoundError:
            raise PreStartError(f"{what}: pre-start program {program} not found") from None
        except PermissionError:
            raise PreStartError(
                f"{what}: pre-start program {program} is not executable (permission denied)"
            ) from None
        except OSError as error:
            raise PreStartError(
                f"{what}: cannot run pre-start program {program}: {error.strerror or error}"
            ) from None
        try:
            status = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            raise PreStartError(
                f"{what}: pre-start program {program} did not finish within {timeout_s:g} s "
                f"and was killed{_tail(output)}"
            ) from None
        except BaseException:
            _kill_group(process)
            raise
        if status != 0:
            how = f"exit status {status}" if status > 0 else _signal_name(-status)
            raise PreStartError(
                f"{what}: pre-start program {program} failed ({how}){_tail(output)}"
            )
        log.debug("%s: pre-start program %s succeeded%s", what, program, _tail(output))


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout=_REAP_S)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
        log.error("pre-start program %s (pid %d) survived SIGKILL", process.args, process.pid)


def _signal_name(number: int) -> str:
    try:
        return f"killed by {signal.Signals(number).name}"
    except ValueError:
        return f"killed by signal {number}"


def _tail(output: IO[bytes]) -> str:
    """The last lines the program wrote, as ': ...' for an error message ('' when silent)."""
    try:
        size = output.seek(0, os.SEEK_END)
        output.seek(max(0, size - _TAIL_BYTES))
        data = output.read()
    except (OSError, ValueError):
        return ""
    text = data.decode("utf-8", "replace").strip()
    if not text:
        return ""
    lines = text.splitlines()[-5:]
    return ": " + " | ".join(line.strip() for line in lines if line.strip())
