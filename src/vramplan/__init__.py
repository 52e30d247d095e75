"""vramplan: how much GPU memory will this step take, where does it go, and does it fit?

>>> import vramplan
>>> est = vramplan.estimate("torchvision:resnet50", batch_size=32)   # doctest: +SKIP
>>> est.peak.allocated_bytes                                        # doctest: +SKIP
"""

__version__ = "0.1.0"

from vramplan.api import estimate, estimate_step  # noqa: E402
from vramplan.errors import UserError  # noqa: E402
from vramplan.estimate import Estimate  # noqa: E402
from vramplan.workload import Recipe  # noqa: E402

__all__ = ["estimate", "estimate_step", "Estimate", "Recipe", "UserError", "__version__"]
