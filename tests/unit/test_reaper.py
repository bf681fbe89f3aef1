"""The reaper: an orphan re-parented to the subreaper is reaped, a child with a waiter keeps its
exit status. Each test runs in a child Python that makes itself a subreaper (pytest stays as it
is), and prints what it saw as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

PRELUDE = textwrap.dedent("""
    import json, os, trio
    from feos._reaper import Reaper
    from feos.daemon import set_subreaper

    set_subreaper()
    seen = {}
    reaper = Reaper(on_reaped=lambda r: seen.setdefault(r.pid, r.status))

    def ended(pid):  # blocks until pid has ended, leaving it a zombie
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
""")


def run_script(body: str) -> Any:
    script = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_an_orphan_is_reaped() -> None:
    out = run_script("""
        async def main():
            reaped = trio.Event()  # the reaper reports on trio's thread
            reaper._on_reaped = lambda r: (seen.setdefault(r.pid, r.status), reaped.set())
            async with trio.open_nursery() as nursery:
                await nursery.start(reaper.run)
                r, w = os.pipe()
                # bash (dash takes only one-digit descriptors in a redirection) starts a grandchild that waits on the pipe, prints its pid and ends
                done = await trio.run_process(
                    ["bash", "-c", f"bash -c 'read x <&{r}' >/dev/null & echo $!"], pass_fds=(r,),
                    capture_stdout=True)
                os.close(r)
                orphan = int(done.stdout)
                parent = int(open(f"/proc/{orphan}/stat").read().rsplit(")", 1)[1].split()[1])
                os.close(w)  # the orphan's read ends: it exits
                with trio.fail_after(20):
                    await reaped.wait()
                nursery.cancel_scope.cancel()
            print(json.dumps({"parent": parent, "me": os.getpid(), "seen": seen,
                              "left": os.path.exists(f"/proc/{orphan}"), "orphan": orphan}))
        trio.run(main)
    """)
    assert out["parent"] == out["me"]  # re-parented to the subreaper
    assert out["seen"] == {str(out["orphan"]): 1}  # `read` at the end of its input: 1
    assert out["left"] is False  # no zombie in /proc


def test_a_trio_child_keeps_its_exit_status() -> None:
    out = run_script("""
        async def main():
            async with trio.open_nursery() as nursery:
                await nursery.start(reaper.run)
                ran = await trio.run_process(["sh", "-c", "exit 7"], check=False)
                proc = await trio.lowlevel.open_process(["sh", "-c", "exit 8"])
                await trio.to_thread.run_sync(ended, proc.pid)
                looked = reaper.reap()  # while it is a zombie
                waited = await proc.wait()
                nursery.cancel_scope.cancel()
            print(json.dumps({"ran": ran.returncode, "waited": waited,
                              "looked": [r.pid for r in looked], "seen": list(seen)}))
        trio.run(main)
    """)
    assert out == {"ran": 7, "waited": 8, "looked": [], "seen": []}


def test_a_claimed_child_of_the_main_thread_is_left_to_its_waiter() -> None:
    out = run_script("""
        env = {"PATH": os.environ["PATH"]}
        claimed = os.posix_spawn("/bin/sh", ["sh", "-c", "exit 9"], env)
        reaper.claim(claimed)
        other = os.posix_spawn("/bin/sh", ["sh", "-c", "exit 5"], env)
        ended(claimed)
        ended(other)
        looked = {r.pid: r.status for r in reaper.reap()}
        status = os.waitid(os.P_PID, claimed, os.WEXITED).si_status
        print(json.dumps({"reaped": looked == {other: 5}, "status": status}))
    """)
    assert out == {"reaped": True, "status": 9}
