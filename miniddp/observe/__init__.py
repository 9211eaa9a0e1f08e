"""What the core tells an observer, and the models a measurement is set against: nothing here
changes a gradient, and nothing here measures (the instruments that do are
miniddp/instruments/: the simulated link's process group, timeline views, activation memory).

events.py          the observer a core class calls as a step happens, and the Recorder
                   an instrument attaches to it (none attached: one empty call)
timeline.py        events into steps and their summary: overlap, tail, launches
link.py            a slow network link's model: latency, bandwidth, each collective's wire bytes
overlap_model.py   the alpha-beta model of a bucketed step, to set a measurement against
"""
