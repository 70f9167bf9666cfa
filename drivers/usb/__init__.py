"""USB driver: whole USB devices by vendor, product, serial, class or port, each handed over
as its /dev/bus/usb node plus the tty, hidraw and video nodes its interfaces expose."""
