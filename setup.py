"""Map the deployment folders onto subpackages of ``asyncrl``.

``learner/``, ``generators/`` and ``buffer/`` sit beside ``asyncrl/`` so the
tree shows the deployment, but they install as ``asyncrl.learner`` and so on,
so no generic top-level names leak into a user's environment. Subpackages are
discovered, not listed, so the wheel never misses one that editable mode finds.
"""

from setuptools import find_packages, setup

MAPPED = {
    "asyncrl": "asyncrl",
    "asyncrl.learner": "learner",
    "asyncrl.generators": "generators",
    "asyncrl.buffer": "buffer",
}

packages: list[str] = []
package_dir: dict[str, str] = {}
for package, folder in MAPPED.items():
    package_dir[package] = folder
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
