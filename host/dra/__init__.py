"""Dynamic Resource Allocation: serving configured resources to the kubelet's DRA manager."""
