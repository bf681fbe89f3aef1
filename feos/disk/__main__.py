"""`python -m feos.disk`: diskd (as the `diskd` entry point runs it)."""

from . import main

main()
