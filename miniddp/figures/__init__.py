"""Pictures of every idea: `python -m miniddp.figures --out DIR` draws them all as PNGs.

    01_messages.png        each collective's messages step by step, tree and ring at W = 4
    03_buckets.png         the bucket layout over a model, before and after the rebuild
    04_timelines.png       one step of each rung of the ladder, compute and communication lanes
    04_sweep.png           step time against bucket size, measured and the alpha-beta model
    00_accumulation.png    gradient accumulation against one big batch
    05_no_sync.png         k micro-steps under no_sync, then the synced one, on a time axis

`draw.py` turns data into pictures; `__main__.py` gathers the data (small jobs of 2-4 ranks, and
chapter 04 run over the simulated link) and calls it. Chapters draw their own run with `--plot`.
"""
