"""The one compiled part of the Python package: the Maglev table fill
(loader/_maglev.c). Everything else is declared in pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("kxlb.loader._maglev", ["loader/_maglev.c"], extra_compile_args=["-O2"])])
