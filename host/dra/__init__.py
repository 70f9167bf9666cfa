"""Dynamic Resource Allocation: imported only when a resource is configured with api = "dra"."""
