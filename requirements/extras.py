"""Prints the requirements of pyproject.toml's optional-dependency groups named on the
command line, one per line (the Makefile installs them without rebuilding the package)."""

import sys
import tomllib
from pathlib import Path

extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())[
    "project"]["optional-dependencies"]
unknown = [name for name in sys.argv[1:] if name not in extras]
if unknown:
    sys.exit(f"unknown extras {unknown}; pyproject.toml has {sorted(extras)}")
print("\n".join(dict.fromkeys(req for name in sys.argv[1:] for req in extras[name])))
