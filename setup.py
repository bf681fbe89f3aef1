"""The one thing pyproject.toml cannot say: feos._native and feos._nghttp2, the compiled modules,
are built from native/build.py by cffi (out of line, API mode) as part of every install, editable
or not."""

from setuptools import setup

setup(cffi_modules=["native/build.py:ffibuilder", "native/build.py:nghttp2_builder"])
