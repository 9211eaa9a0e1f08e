"""Pictures of every idea: `python -m miniddp.figures --out DIR` draws them all as PNGs.

    01_messages.png        each collective's messages step by step, tree and ring at W = 4
    03_buckets.png         the bucket layout over a model, before and after the rebuild
    04_timelines.png       one step of each rung of the ladder, compute and communication lanes
    04_sweep.png           step time against bucket size, measured and the alpha-beta model
    00_accumulation.png    gradient accumulation against one big batch
    02_data_parallel.png   replicas, each fed its shard of the batch, and the all-reduce
    06_failover.png        the crash, the restart and the resume on a step axis
    05_no_sync.png         k micro-steps under no_sync, then the synced one, on a time axis
    11_memory.png          memory per rank under DDP and each ZeRO stage, against the formulas
    11c_memory.png         one step's memory on a rank, activations included, per layout and
                           activation checkpointing, measured by chapter 11c
    12_loss.png            chapter 12's GPT: MiniDDP's and torch's DDP's loss curves
    13_tensor_parallel.png who holds which block of each weight, and where the all-reduces sit
    14_pipeline.png        GPipe and 1F1B on 4 stages, measured
    16_three_d.png         the (pp, dp, tp) mesh of 8 ranks and one 1F1B step of all of them

`draw.py` turns data into pictures; `__main__.py` gathers the data (small jobs of 2-4 ranks, and
chapter 04 run over the simulated link) and calls it. Chapters draw their own run with `--plot`.
"""
