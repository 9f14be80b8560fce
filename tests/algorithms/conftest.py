"""The algorithm tests import ``verl_reference`` (verl's functions the step does not run) from
this folder, as ``verl_parity.py`` does when run as a script."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
