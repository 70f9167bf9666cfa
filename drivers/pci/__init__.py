"""pci driver: any PCI function with character devices of its own, served by config alone
(Hailo-8 and other edge NPUs, capture cards, custom boards)."""
