"""feos.disk: diskd, the pods' and the volumes' disks as stacks of read-only layers under a
writable top of their own (docs/disk.md); `Diskd`, feosd's client of it."""

from ._client import WAIT_S as WAIT_S
from ._client import Diskd as Diskd
from ._client import DiskdConnection as DiskdConnection
from ._model import EMPTY_DIGEST as EMPTY_DIGEST


def main() -> None:
    from ._daemon import main as daemon_main

    daemon_main()


def ctl() -> None:
    from ._ctl import main as ctl_main

    ctl_main()
