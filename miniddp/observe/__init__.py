"""What only observes or simulates training: nothing here changes a gradient.

events.py          the observer a core class calls as a step happens, and the Recorder
                   an instrument attaches to it (none attached: one empty call)
timeline.py        events into steps and their summary: overlap, tail, launches
timeline_views.py  a step drawn three ways: ASCII, matplotlib, Chrome's trace viewer
link.py            a simulated slow network link (latency and bandwidth) under the collectives
overlap_model.py   the alpha-beta model of a bucketed step, to set a measurement against
activation_memory.py  the bytes a forward leaves for its backward, per layer, by storage
"""
