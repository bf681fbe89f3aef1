"""feos-host-init: PID 1 when FeOS is the node's operating system (docs/host-init.md).

It sets the machine up (the root off the initramfs, the filesystems, the modules, the uplink by
RA, DHCPv6 and DHCPv4, resolv.conf, the clock by NTP), keeps diskd and feosd running, reaps
orphans and reboots or powers off on the spec's signals. It serves no API.
"""

from ._main import main as main
