"""The DRM nodes a GPU's kernel driver registered, found from the PCI function itself.

/dev/dri/card0 is not "the first GPU": on a server the BMC's VGA (ast, mgag200) often takes it,
and the numbering follows probe order. The kernel links each DRM minor to its parent under the
function's own ``drm/`` folder (``.../0000:c1:00.0/drm/card1``, ``.../drm/renderD128``), so
reading that folder pairs nodes to GPUs without guessing. Connector folders (``card1-DP-1``)
live inside ``card1/`` and are not listed here; ``controlD64`` (old kernels) is not a node any
container needs.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Tuple

from device_plugin_host import HostFS

_CARD = re.compile(r"card(\d+)\Z")
_RENDER = re.compile(r"renderD(\d+)\Z")


class DrmNodes(NamedTuple):
    cards: Tuple[str, ...]  # "card1", lowest number first
    renders: Tuple[str, ...]  # "renderD128"

    @property
    def names(self) -> Tuple[str, ...]:
        return self.cards + self.renders


def drm_nodes(host: HostFS, function_path: str) -> DrmNodes:
    """Card and render node names under a PCI function's ``drm/`` folder (empty when the
    driver is not bound or registered none)."""
    cards = []
    renders = []
    for name in host.listdir(f"{function_path}/drm"):
        card = _CARD.match(name)
        if card:
            cards.append((int(card.group(1)), name))
            continue
        render = _RENDER.match(name)
        if render:
            renders.append((int(render.group(1)), name))
    return DrmNodes(
        cards=tuple(name for _, name in sorted(cards)),
        renders=tuple(name for _, name in sorted(renders)),
    )
