"""A registry's gate for the token rule's tests, run by integration/test_pods_templates.py inside
its registry's namespace: `python registry_gate.py UPSTREAM BIND PORT GOOD LOG`.

It is test_guest_registry's AuthProxy with anonymous GETs let through: it passes on GETs that carry
no Authorization (an anonymous pull) or `Bearer GOOD`, answers 401 invalid_token to any other token
(a registry refuses a token it does not accept, even for a public repository), and writes one line
per GET to LOG (`PATH token|-`), so that a test can tell a pull that fetched blobs from one that
asked for the manifest only.
"""

from __future__ import annotations

import sys

from test_guest_registry import AuthProxy

if __name__ == "__main__":
    upstream, bind, port, good, log = sys.argv[1:6]
    AuthProxy(upstream, good, bind, int(port), anonymous=True, log=log).thread.join()
