"""What keeps a job alive and names its faults, around whatever parallelism it trains with.

env.py              torchrun's environment (RANK, LOCAL_RANK, ...), the backend and device,
                    starting and ending the process group (`init_distributed`, `cleanup`)
faults.py           the one wait seam: a collective that cannot finish names itself and the
                    rank that is missing (`wait_for`, `CollectiveFailed`); public as
                    `miniddp.faults`
notes.py            what ranks leave for each other in the store while something is wrong
agree.py            every rank's few numbers on every rank (`gather_rows`), so that a mistake
                    one rank sees is refused on all of them, before the collective it breaks
meet.py             meeting points every rank must reach (cleanup, checkpoints), checked
                    through the store instead of a barrier that hangs
checkpoint.py       atomic, complete checkpoints and a bit-identical resume; public as
                    `miniddp.checkpoint`
checkpoint_file.py  the file format under it: written whole or not at all
full_tensors.py     a tensor-parallel or pipelined model's state whole for the file, and each
                    rank's part cut back out on load (read from the parameters' marks)
"""
