"""The mistakes zoo: the classic DDP bugs (and one lesson in bit-reproducibility), each one a
small variant of a rung of the ladder (miniddp/steps/) or of the training loop with ONE change,
and each one caught by a test (tests/test_mistakes.py). Teaching material, not MiniDDP's API:
nothing here is exported.

Each file's docstring says the symptom, why it happens, and how torch's DDP avoids it (or
doesn't). Chapter 09 (tutorials/09_mistakes.py) runs a handful of them next to their fixes.

    no_sync_backward_only.py      no_sync() around backward only: the forward decides
    hook_averages_weights.py      a post-accumulate hook that all-reduces the parameter
    divide_after_sum.py           dividing after the SUM: right, but other bits at W = 3
    no_buffer_broadcast.py        BatchNorm's buffers never broadcast
    no_construction_broadcast.py  ranks seeded differently, no broadcast at construction
    ready_order.py                buckets launched in the order they filled
    grad_before_wait.py           .grad read before the all-reduce's wait
    missing_set_epoch.py          DistributedSampler without set_epoch
    loss_not_divided.py           the loss not divided by the accumulation steps
    unused_parameter.py           a parameter without a gradient, find_unused_parameters=False
    step_inside_no_sync.py        optimizer.step() inside no_sync()
    correct_loop.py               the training step the loop mistakes get wrong, done right
"""
