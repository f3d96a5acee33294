"""`Z3GUARD_AUTOINSTALL=1`: install z3guard in a process as soon as this module is imported.

Meant for a one-line `.pth` file in site-packages (`import z3guard.autoinstall`), so that processes
you do not start yourself (test harnesses' forkserver ranks, launchers' workers) are guarded too.
Without the variable, importing this does nothing.
"""
import os

if os.environ.get("Z3GUARD_AUTOINSTALL") == "1":
    import z3guard

    z3guard.install()
