"""`python -m miniddp.figures --out DIR`: the figures, which live with the other instruments in
miniddp/instruments/figures/ (they draw the library's runs from outside; this is only their
door)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("miniddp.instruments.figures", run_name="__main__", alter_sys=True)
