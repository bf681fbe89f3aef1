"""feos.pods."""
