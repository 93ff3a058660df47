"""Build glue: map the import packages onto their folders and build lmd._native.

pyproject.toml holds the metadata; setuptools' package-dir mapping renames `daemon/`
to `lmd` and `clients/` to `lmd_client` (scikit-build-core cannot), and pybind11's
helpers compile every C++ file under native/ into the one extension module.
"""

from __future__ import annotations

from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

PACKAGE_DIRS = {"lmd": "daemon", "lmd_client": "clients"}


def subpackages(package: str, folder: str) -> list[str]:
    found = [package]
    for init in sorted(glob(f"{folder}/**/__init__.py", recursive=True)):
        parts = init.split("/")[1:-1]
        if parts:
            found.append(".".join([package, *parts]))
    return found


native = Pybind11Extension(
    "lmd._native",
    sorted(glob("native/*.cpp")),
    include_dirs=["native"],
    cxx_std=17,
    extra_compile_args=["-O3", "-Wall"],
    libraries=["dl"],
)

packages = [p for name, folder in PACKAGE_DIRS.items() for p in subpackages(name, folder)]
package_dir = dict(PACKAGE_DIRS)
for p in packages:
    head, *rest = p.split(".")
    package_dir.setdefault(p, "/".join([PACKAGE_DIRS[head], *rest]))

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"lmd_client": ["py.typed"], "lmd": ["py.typed"]},
    ext_modules=[native],
    cmdclass={"build_ext": build_ext},
)
