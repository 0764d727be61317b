"""The machinery of a run, behind a few named calls from train.py and async_rl.py: the command
line (cli), loading the task and the policy (loading, pretrained), checkpoints and resuming
(checkpoint), stopping on signals and errors (stopping), the run folder (runfolder), several
processes (distributed), reporting and curves (report, curves), the engineered update step
(engineered_update), generation worker processes (workers), faster decoding on a GPU
(fast_decoding), the shared-prefix update (shared_prefix), loading a model with LoRA (policy),
the end of a round (round_end) and the embedded demo model (demo_model). None of it is a step of
the method. Two pieces compute a quantity of the method, log pi_theta, another way, each tested
equal to replay_rl.completion_logp: chunked_completion_logp (engineered_update) and
shared_prefix_logp (shared_prefix)."""
