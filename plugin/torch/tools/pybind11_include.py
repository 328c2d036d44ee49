"""Prints pybind11's include folder (pybind11 from PyPI, a build requirement) or exits 1."""
import sys

try:
    import pybind11
except ImportError:
    sys.exit(1)
print(pybind11.get_include())
