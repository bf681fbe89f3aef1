"""feosctl pod exec's flags as docker exec's (-i, -t, -w, -e), the process a guest's exec runs
(the container's own, the call's env and directory over it), the terminal's raw mode given
back, and --wait's progress lines."""

from __future__ import annotations

import io
import os
import termios
from typing import Any

import pytest

from feos.cli._commands import UsageError
from feos.cli._main import build_parser
from feos.cli._pods import Progress, RawTerminal, exec_options, exec_request
from feos.guest import _oci


def _exec(*argv: str) -> tuple[Any, list[str]]:
    args = build_parser().parse_args(["pod", "exec", *argv])
    return args, exec_options(args)


def test_flags_before_the_id_and_after_it() -> None:
    args, command = _exec("-it", "-w", "/srv", "-e", "A=1", "p1", "-e", "B=2=3", "--", "sh", "-l")
    assert command == ["sh", "-l"]
    assert (args.stdin, args.tty, args.workdir) == (True, True, "/srv")
    assert exec_request(args, command, (33, 101)) == {
        "id": "p1", "container": "main", "command": ["sh", "-l"], "workingDir": "/srv",
        "env": [{"key": "A", "value": "1"}, {"key": "B", "value": "2=3"}], "tty": True,
        "rows": 33, "cols": 101,
    }  # fmt: skip


def test_no_flags_no_terminal_and_the_containers_own_directory() -> None:
    args, command = _exec("p1", "pwd", "--", "x")
    assert command == ["pwd", "--", "x"]  # a -- of the command's own stays its
    params = exec_request(args, command)
    assert params["workingDir"] == "" and params["env"] == [] and params["tty"] is False
    assert "rows" not in params


def test_long_forms_after_the_id() -> None:
    args, command = _exec("p1", "--tty", "--workdir=/tmp", "--env", "K=", "-c", "side", "--", "id")
    assert (args.tty, args.workdir, args.container, args.env) == (True, "/tmp", "side", ["K="])
    assert exec_request(args, command)["env"] == [{"key": "K", "value": ""}]


@pytest.mark.parametrize("bad", ["NOEQUALS", "=value"])
def test_an_env_without_a_key_is_refused(bad: str) -> None:
    args, command = _exec("p1", "-e", bad, "--", "true")
    with pytest.raises(UsageError, match="KEY=VALUE"):
        exec_request(args, command)


def test_an_unknown_flag_after_the_id_is_refused() -> None:
    with pytest.raises(UsageError, match="not options of pod exec"):
        _exec("p1", "--privileged", "--", "true")


BASE = {"user": {"uid": 1000, "gid": 1000}, "args": ["/bin/server"], "cwd": "/app",
        "env": ["PATH=/bin", "FROM_IMAGE=yes", "FROM_SPEC=spec"], "noNewPrivileges": True}  # fmt: skip


def test_exec_runs_as_the_containers_process() -> None:
    p = _oci.exec_process(BASE, ["sh"], [], "", None)
    assert p["cwd"] == "/app" and p["user"] == {"uid": 1000, "gid": 1000}
    assert p["env"] == BASE["env"] and p["args"] == ["sh"]
    assert p["terminal"] is False and "consoleSize" not in p and p["noNewPrivileges"]


def test_the_calls_env_and_directory_win() -> None:
    p = _oci.exec_process(BASE, ["sh"], ["FROM_SPEC=call", "NEW=1"], "/tmp", None)
    assert p["cwd"] == "/tmp"
    assert p["env"] == ["PATH=/bin", "FROM_IMAGE=yes", "FROM_SPEC=call", "NEW=1"]
    assert BASE["env"][-1] == "FROM_SPEC=spec"  # the container's own process is not changed


def test_a_terminal_has_the_size_asked_or_24_by_80() -> None:
    assert _oci.exec_process(BASE, ["sh"], [], "", (33, 101))["consoleSize"] == {
        "height": 33, "width": 101}
    p = _oci.exec_process(BASE, ["sh"], [], "", (0, 0))
    assert p["terminal"] is True and p["consoleSize"] == {"height": 24, "width": 80}


def test_raw_mode_is_given_back_on_an_error() -> None:
    master, slave = os.openpty()
    try:
        before = termios.tcgetattr(slave)
        with pytest.raises(RuntimeError), RawTerminal(slave):  # noqa: PT012
            assert not termios.tcgetattr(slave)[3] & termios.ICANON  # raw inside
            raise RuntimeError("the stream broke")
        assert termios.tcgetattr(slave) == before
    finally:
        os.close(master)
        os.close(slave)


def test_progress_a_line_a_step_then_the_state() -> None:
    out = io.StringIO()
    p = Progress("web", False, out)
    for step in ["", "disk", "disk", "vm", "guest", "guest", "volumes", "containers"]:
        p.step(step)
    p.settled("failed", "image not found")
    lines = [line.rsplit(" (", 1)[0] for line in out.getvalue().splitlines()]
    assert lines == ["pod web: disk", "pod web: vm", "pod web: guest", "pod web: volumes",
                     "pod web: containers", "pod web: failed: image not found"]  # fmt: skip
    quiet = io.StringIO()
    Progress("web", True, quiet).settled("running", "")
    assert quiet.getvalue() == ""


def test_open_exec_passes_the_terminal_and_directory_to_the_guest() -> None:
    import asyncio

    from feos.pods._streams import open_exec

    class Empty:
        async def __aiter__(self) -> Any:
            return
            yield

    class Client:
        async def exec(self, *args: Any, **kwargs: Any) -> Any:
            self.got = (args, kwargs)
            return type("P", (), {"stdout": Empty(), "stderr": Empty()})()

    async def scenario() -> Any:
        client = Client()
        await open_exec(client, "main", ["sh"], ["A=1"], True, "/srv", 33, 101)
        return client.got

    args, kwargs = asyncio.run(scenario())
    assert args == ("main", ["sh"], ["A=1"])
    assert kwargs == {"stdin": True, "tty": True, "working_dir": "/srv", "rows": 33, "cols": 101}
