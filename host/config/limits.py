"""What a config may ask for, and devices two resources claim: the caps and overlap errors.

The caps are far past any real node; they catch a generated file gone wrong before it takes
the host's memory or the kubelet's patience (README: limits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from host.config.errors import ConfigError

if TYPE_CHECKING:
    from host.config.settings import Config
    from host.core.overlap import Overlap


#: Each resource is a gRPC server, a socket and a kubelet registration; more than this is a
#: generated file gone wrong (10,000 took a 23 s reload), not a node. See README.
MAX_RESOURCES = 256


#: 256 resources with long selector lists are well under 1 MiB; a bigger file is a mistake
#: (a log or an image at the path), and must not be read into memory whole.
MAX_CONFIG_BYTES = 4 * 2**20


MAX_REPLICAS = 1024


def overlap_error(config: Config, overlap: Overlap) -> ConfigError:
    """A device claimed by two resources, as one config error naming both and the ids."""
    index = {r.name: i for i, r in enumerate(config.resources)}
    file = config.path or "built-in defaults"
    first = f"resource[{index.get(overlap.first, '?')}] ({overlap.first})"
    second = f"resource[{index.get(overlap.second, '?')}] ({overlap.second})"
    return ConfigError(
        file, f"{second}.selectors",
        f"claims {overlap.describe()} that {first} also claims: two pods could be given one "
        f"device; narrow the selectors, or set shared_with = [\"{overlap.first}\"] if the "
        "two resources are meant to share them")
