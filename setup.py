"""Package layout only (metadata lives in pyproject.toml).

The repository keeps `plugins/` and `probes/` beside `selector/`; the wheel installs them as
`selector.plugins` and `selector.probes`, so the only top-level import package is `selector`.
"""

from setuptools import find_packages, setup

NESTED = {"selector.plugins": "plugins", "selector.probes": "probes"}

packages = find_packages(include=["selector", "selector.*"])
for package, folder in NESTED.items():
    packages += [package + sub[len(folder):] for sub in find_packages(include=[folder, folder + ".*"])]

setup(packages=packages, package_dir=NESTED)
