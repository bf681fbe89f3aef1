"""feos.vmm."""
