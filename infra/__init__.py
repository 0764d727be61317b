"""The machinery of a run, behind a few named calls from train.py and async_rl.py: the command
line (cli), loading the task and the policy (loading, pretrained), checkpoints and resuming
(checkpoint), stopping on signals and errors (stopping), the run folder (runfolder), several
processes (distributed), reporting and curves (report, curves), the engineered update step
(engineered_update), generation worker processes (workers), faster decoding on a GPU
(fast_decoding) and the embedded demo model (demo_model). None of it is the method: a reader
who skips this folder misses nothing of it."""
