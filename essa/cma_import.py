"""pycma (``cma``), imported without the two modules that only its extras use at import time.

``import cma`` loads ``cma.s``, whose first line imports ``matplotlib.pyplot`` (for
``cma.plot``), and ``cma.fitness_models``, which imports ``scipy.stats`` for the Kendall tau of
its surrogate models; each falls back by itself (``cma.plot`` unavailable, pycma's own Kendall
tau) when the import fails. ESSA uses neither: CMAEvolutionStrategy's ask/tell, logging off
(``verbose=-9``), no plots, no surrogate. Those two imports were 1.0 of the 1.25 CPU seconds of
``import cma``, and every ESSA rank paid them at its start (tests/test_*.py start hundreds of
ESSA ranks). So both are refused while pycma loads, and only then: the names are removed again
afterwards, so a later ``import scipy.stats`` or ``matplotlib.pyplot`` (pycma's own plotting
functions import pyplot when called) loads them as usual, and a module the process had already
loaded is left as it is. pycma's numbers do not depend on either: the same run files and
adapters bit for bit (a 2-rank ESSA job compared before and after this module).
"""
from __future__ import annotations

import sys
import warnings

UNUSED_AT_IMPORT = ("matplotlib.pyplot", "scipy.stats")


def _import_cma():
    refused = [name for name in UNUSED_AT_IMPORT if name not in sys.modules]
    for name in refused:
        sys.modules[name] = None  # `import name` raises ImportError
    try:
        with warnings.catch_warnings():
            # cma.s: "Could not import matplotlib.pyplot, therefore ``cma.plot()`` etc. is not
            # available"
            warnings.simplefilter("ignore")
            import cma
    finally:
        for name in refused:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
    return cma


cma = _import_cma()
