"""`python -m miniddp.bench COMMAND`: the benchmarks, which live with the other instruments in
miniddp/instruments/bench/ (they measure the library from outside; this is only their door)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("miniddp.instruments.bench", run_name="__main__", alter_sys=True)
