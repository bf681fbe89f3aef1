"""feosd: a node agent that runs pods as microVMs.

This module imports nothing: feos-guest runs from this package inside the microVM, where every
import costs boot time.
"""

__version__ = "0.1.0"
