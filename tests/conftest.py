"""Before any test imports torch: OpenMP threads sleep while they wait (as `alignflow` sets for its runs), so
the suite's two-thread processes do not spin against each other on a loaded machine."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
