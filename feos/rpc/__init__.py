"""feos.rpc."""
