"""feos-guest's entry point: `python -m feos.guest [options]`, or PID 1 through the launcher.

Options (all for running the agent outside a guest, as the tests do; the guest passes none):
  --link L          a virtio port name, vsock, unix:PATH (connect) or fd:N (default: the kernel's
                    feos.link=, else feos.guest)
  --data DIR        the data volume (/data)         --volumes DIR  the volumes' mounts (/volumes)
  --run DIR         runtime files (/run/feos-guest) --crun-root DIR  crun's state (/run/crun)
  --drive N=PATH    the block device of drive N (default: by serial, else by place)
  --crun-cgroups M  crun's --cgroup-manager (disabled: on a host with hybrid cgroups)
  --resolv-conf F   the guest's resolv.conf, which containers bind-mount (/run/resolv.conf)
  --sys-block DIR, --sys-net DIR   where drives and network devices are looked for (/sys/...)
"""

from __future__ import annotations

from . import _lean

with _lean.imports():  # the agent's start under TCG is mostly its imports: see _lean
    import asyncio
    import os
    import signal
    import sys
    import time
    import traceback

    from . import _proc
    from ._agent import Agent, Options


def parse(argv: list[str]) -> Options:
    opts = Options()
    names = {"--link": "link", "--data": "data_dir", "--volumes": "volumes_dir", "--run": "run_dir",
             "--crun-root": "crun_root", "--sys-block": "sys_block", "--resolv-conf": "resolv_conf",
             "--crun-cgroups": "crun_cgroups",
             "--sys-net": "sys_net"}  # fmt: skip
    args = iter(argv)
    for arg in args:
        value = next(args, None)
        if value is None:
            raise SystemExit(f"feos-guest: {arg} needs a value")
        if arg in names:
            setattr(opts, names[arg], value)
        elif arg == "--drive":
            index, _, path = value.partition("=")
            opts.drives[int(index)] = path
        else:
            raise SystemExit(f"feos-guest: unknown option {arg}\n{__doc__}")
    return opts


async def _amain(agent: Agent) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT: Ctrl-Alt-Del when PID 1
        _proc.on_signal(sig, _on_signal, agent)
    if agent.opts.pid1:
        loop.call_later(1.0, _take_ctrl_alt_del)
    await agent.run()


def _on_signal(agent: Agent) -> None:
    if not agent.done.is_set() and agent._shutdown is None:
        agent.request_shutdown(False)


def _take_ctrl_alt_del() -> None:
    """The kernel sends PID 1 SIGINT on Ctrl-Alt-Del instead of rebooting at once."""
    import ctypes

    ctypes.CDLL(None).reboot(0)  # RB_DISABLE_CAD


def main(argv: list[str] | None = None, ready: float | None = None) -> int:
    """ready: when the launcher's interpreter had started (its imports came after)."""
    opts = parse(sys.argv[1:] if argv is None else argv)
    # The clock: CLOCK_MONOTONIC, from the guest's boot (bench/guest_boot.py reads it).
    since = f", python at {ready:.3f} s" if ready is not None else ""
    print(f"feos-guest: starting (pid {os.getpid()}, at {time.monotonic():.3f} s{since})",
          flush=True)  # fmt: skip
    agent = None
    try:
        agent = Agent(opts)
        asyncio.run(_amain(agent))
    except BaseException as e:
        if not opts.pid1:
            raise
        print(f"feos-guest: ended: {''.join(traceback.format_exception(e))}", flush=True)
    if opts.pid1:
        from ._system import power_off

        power_off(agent.reboot if agent else False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
