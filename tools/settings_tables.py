"""Prints docs/api.md's tables of environment variables, made from the one registry
(`raytrain_x.common.settings`); tests/unit/test_knobs.py holds the docs equal to them.

Run: .venv/bin/python tools/settings_tables.py
"""

from raytrain_x.common import settings

for scope in (settings.USER, settings.LAUNCHER, settings.INTERNAL):
    print(f"{scope}:\n\n{settings.table(scope)}\n")
