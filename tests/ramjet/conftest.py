"""Unit tests of `ramjet/`, one folder per package. The fixtures shared across folders
(`policy_fakes`, `reports_fixtures`, `zmq_endpoints`) live here and are importable from
every folder below."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
