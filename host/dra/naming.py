"""Names the API server accepts, derived from our own identifiers.

Upstream (kubernetes/kubernetes pkg/apis/resource/validation/validation.go) validates a device
name as a DNS label (ValidateDNS1123Label: [a-z0-9]([-a-z0-9]*[a-z0-9])?, at most 63), a pool
name as "/"-separated DNS subdomains of at most 253 characters in all, and a driver name as a
CSI driver name (a DNS subdomain of at most 63). Device ids are PCI addresses, serials and
UUIDs with ':' '.' '_' and upper case, so they need mapping; the mapping must be stable
(claims and the scheduler refer to devices by name) and must not merge two ids into one name,
hence the short hash whenever the readable part is not the id itself.
"""

from __future__ import annotations

import hashlib
import re
from typing import Optional

DNS_LABEL_MAX = 63
DRIVER_NAME_MAX = 63
POOL_NAME_MAX = 253
DRIVER_DOMAIN = "device-plugin-host.io"

_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_NOT_LABEL_CHARS = re.compile(r"[^a-z0-9]+")
_HASH_LEN = 8


def is_dns_label(name: str) -> bool:
    return len(name) <= DNS_LABEL_MAX and bool(_LABEL.match(name))


def is_dns_subdomain(name: str, max_len: int = 253) -> bool:
    return 0 < len(name) <= max_len and bool(_SUBDOMAIN.match(name))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_LEN]


def _label(text: str, max_len: int = DNS_LABEL_MAX) -> str:
    """``text`` itself when it is a label, else a readable label plus a hash of ``text``."""
    if len(text) <= max_len and _LABEL.match(text):
        return text
    readable = _NOT_LABEL_CHARS.sub("-", text.lower()).strip("-")
    readable = readable[: max_len - _HASH_LEN - 1].rstrip("-")
    suffix = _digest(text)
    return f"{readable}-{suffix}" if readable else f"x{suffix}"


def dra_device_name(device_id: str) -> str:
    """The ResourceSlice device name of ``device_id``: a lowercase RFC 1123 label, <= 63.

    "0000:3b:00.0" -> "0000-3b-00-0-<8 hex>"; an id that is already a label stays as it is.
    """
    if not device_id:
        raise ValueError("a device id must not be empty")
    return _label(device_id)


def pool_name(resource: str, node_name: str) -> str:
    """One pool per resource per node: "<node>/<resource>", each segment a DNS subdomain.

    Keyed by resource as well as node because two resources may share one configured driver
    name, and a pool is identified by (driver, pool): they must not overwrite each other.
    """
    if not is_dns_subdomain(node_name):
        raise ValueError(f"node name {node_name!r} is not a DNS subdomain")
    segments = []
    for part in resource.split("/"):
        if is_dns_subdomain(part):
            segments.append(part)
        else:
            segments.append(_label(part))
    name = "/".join([node_name, *segments])
    if len(name) > POOL_NAME_MAX:
        name = f"{node_name}/{_label(resource)}"
    if len(name) > POOL_NAME_MAX:
        raise ValueError(f"node name {node_name!r} is too long for a pool name")
    return name


def driver_name_error(name: str) -> Optional[str]:
    """Why ``name`` is not a DRA driver name (upstream: ValidateCSIDriverName), or None."""
    if not name:
        return "must not be empty"
    if len(name) > DRIVER_NAME_MAX:
        return f"is {len(name)} characters; at most {DRIVER_NAME_MAX} are allowed"
    if not is_dns_subdomain(name.lower()):
        return "must be a DNS subdomain (lowercase [a-z0-9], '-' and '.' inside)"
    if name != name.lower():
        return "must be lower case"
    return None


# Host drivers whose resources are one vendor's devices and their partitions: all of a vendor's
# resources share one DRA driver name ("gpu.<vendor domain>.device-plugin-host.io"), so a GPU,
# its MIG devices or compute partitions and one DeviceClass per profile all select by
# attributes of one driver (as NVIDIA's gpu.nvidia.com does), and a GPU and its partitions can
# be published in one pool with shared counters.
VENDOR_DRIVERS = frozenset({"gpu"})


def driver_name(resource: str, configured: Optional[str], host_driver: Optional[str] = None) -> str:
    """The DRA driver name for ``resource``: ``configured`` (validated) or one derived from it.

    "nvidia.com/gpu" -> "gpu.nvidia.com.device-plugin-host.io": the resource's own name and
    domain keep two vendors' "gpu" apart, under a domain we own as upstream asks ("should end
    with a DNS domain owned by the vendor of the driver"). For a ``host_driver`` in
    VENDOR_DRIVERS the name is the host driver's and the vendor domain's alone:
    "nvidia.com/mig-1g.10gb" (driver "gpu") -> "gpu.nvidia.com.device-plugin-host.io" too, and
    "gpu.intel.com/xe" -> "gpu.intel.com.device-plugin-host.io".
    """
    if configured:
        error = driver_name_error(configured)
        if error:
            raise ValueError(f"dra_driver_name {configured!r} {error}")
        return configured
    domain, _, short = resource.rpartition("/")
    if host_driver in VENDOR_DRIVERS and domain:
        head = f"{host_driver}."
        vendor = domain[len(head):] if domain.startswith(head) else domain
        resource = f"{vendor}/{host_driver}"
        domain, short = vendor, host_driver
    labels = [_label(short)] if short else []
    for part in domain.split(".") if domain else []:
        labels.append(_label(part))
    candidate = ".".join([*labels, DRIVER_DOMAIN])
    if len(candidate) <= DRIVER_NAME_MAX and is_dns_subdomain(candidate):
        return candidate
    room = DRIVER_NAME_MAX - len(DRIVER_DOMAIN) - 1
    return f"{_label(resource, room)}.{DRIVER_DOMAIN}"
