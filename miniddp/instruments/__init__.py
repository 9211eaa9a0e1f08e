"""The instruments: what measures, draws and slows the library from outside, as a user would.
Nothing in the library imports them (tests/test_layers.py: the top floor).

    bench/               `python -m miniddp.bench COMMAND`: every parallelism timed against
                         torch's own, and the models the chapters verify set against the clock
    figures/             `python -m miniddp.figures`: every picture the chapters and README show
    link_group.py        the simulated slow link: a process group wrapping gloo, which every
                         collective and send crosses (the link's model: miniddp/observe/link.py)
    timeline_views.py    a recorded step drawn three ways: ASCII, matplotlib, Chrome's trace viewer
    activation_memory.py the bytes a forward leaves for its backward, read off autograd's saved
                         tensors (what chapter 11c sets against Korthikanti's formula)

The core tells an observer what happens at named points (miniddp/observe/events.py), and these
listen; the chapters run them beside the lessons.
"""
