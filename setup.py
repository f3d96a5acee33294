"""Everything is in pyproject.toml but one step setuptools has no option for: shipping z3guard.pth at the top
of site-packages, where Python's start-up reads it (the `Z3GUARD=1` switch, src/z3guard_startup.py)."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("src", "z3guard.pth"), os.path.join(self.build_lib, "z3guard.pth"))


setup(cmdclass={"build_py": BuildWithStartupHook})
