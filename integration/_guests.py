"""This tree's guest alone, for a test or a benchmark that needs what this tree's agent does.

The installed guests (/usr/lib/feos/guest) are the machine's: another tree's `hack/guest-image`
may install a newer one at any time, and feosd boots the newest. `own_guest(root)` installs this
tree's (reused when it is there), links its directory alone into root/guests, and points
$FEOS_GUEST_DIR there (feosd, diskd and this process then see no other), until `restore()`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


class OwnGuest:
    def __init__(self, root: Path) -> None:
        self.root = root / "guests"
        self._was = os.environ.get("FEOS_GUEST_DIR")

    def install(self) -> OwnGuest:
        env = {k: v for k, v in os.environ.items() if k != "FEOS_GUEST_DIR"}
        out = subprocess.run([str(REPO / "hack/guest-image")], check=True, text=True, env=env,
                             stdout=subprocess.PIPE, timeout=1200).stdout  # fmt: skip
        installed = Path(out.strip().splitlines()[-1])
        self.root.mkdir(parents=True, exist_ok=True)
        mine = self.root / installed.name
        if not mine.exists():
            try:
                subprocess.run(["cp", "-al", str(installed), str(mine)], check=True,
                               stderr=subprocess.DEVNULL)  # fmt: skip
            except subprocess.CalledProcessError:
                shutil.rmtree(mine, ignore_errors=True)
                shutil.copytree(installed, mine)
        os.environ["FEOS_GUEST_DIR"] = str(self.root)
        return self

    def restore(self) -> None:
        if self._was is None:
            os.environ.pop("FEOS_GUEST_DIR", None)
        else:
            os.environ["FEOS_GUEST_DIR"] = self._was
