"""feos-guest, the agent inside the microVM, and the node's client of it.

Imports nothing: the guest's start time depends on it.
"""
