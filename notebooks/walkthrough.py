# %% [markdown]
# # Experience replay for LLM RL post-training, step by step
#
# This notebook walks the method of [replay-rl](../README.md) with the project's own functions:
# the task and the demo model, one round of rollouts with their rewards and advantages, the
# replay buffer with its ages, one update with its importance weights, a short run with its
# curve, and at the end a real model on GSM8K (on a GPU).
#
# The symbols are the README's table: pi_theta the policy being trained, mu the behaviour
# policy (the one that sampled a rollout), o_t a completion token, rho_t = pi_theta(o_t) /
# mu(o_t), w_t = min(rho_t, C) with C the cap, A the advantage, P prompts x G completions
# = R new rollouts a round, N the buffer, B the batch, K updates a round, y = K*B/R the replay
# ratio (R counts the rollouts stored), T the temperature.
#
# **Colab**: set `REPO_URL` in the next cell to the repository that holds the project, then run
# all. The cell installs what Colab lacks and keeps Colab's own torch. For the last cell pick a
# GPU first (Runtime > Change runtime type > T4 GPU); everything before it runs on a CPU.

# %%
# Setup: the project's code (cloned from REPO_URL unless this notebook sits inside it) and, on
# Colab, the packages of requirements.txt except torch (Colab's torch stays).
import os
import re
import subprocess
import sys
from pathlib import Path

REPO_URL = "https://github.com/YOUR-ACCOUNT/replay-rl"      # the repository that holds replay-rl
SMALL = os.environ.get("REPLAY_RL_NOTEBOOK_SMALL") == "1"  # tiny settings: the test suite, on CPU

around = [Path.cwd(), *Path.cwd().parents, Path("replay-rl").resolve()]     # the last: an earlier clone
root = next((d for d in around if (d / "train.py").is_file()), None)
if root is None:
    if "YOUR-ACCOUNT" in REPO_URL:
        raise SystemExit("set REPO_URL in this cell to the repository that holds replay-rl")
    subprocess.run(["git", "clone", "--depth", "1", REPO_URL, "replay-rl"], check=True)
    root = Path("replay-rl").resolve()
os.chdir(root)
sys.path.insert(0, str(root))
if "google.colab" in sys.modules:
    wanted = [line.split("#")[0].strip() for line in open("requirements.txt")]
    wanted = [w for w in wanted if w and re.split(r"[<>=!~ ]", w)[0] != "torch"]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *wanted], check=True)
from infra import report  # noqa: E402

report.quiet_libraries()                                    # no weight-loading bars, no kernel notices
print("project:", root, "| small settings" if SMALL else "")

# %% [markdown]
# ## The task and the demo model
#
# The embedded task is 2-digit addition: the prompt `37+45=`, the reward 1 for the exact sum and
# 0 otherwise. The demo model is a 0.53M-parameter Llama with a character tokenizer, warm-started
# by a *sloppy teacher* who forgets each carry 70% of the time (`infra/demo_model.py`; its weights ship with
# the project). `load_policy` wraps it with a fresh LoRA adapter: that is pi_theta.

# %%
import random

import torch

from infra import demo_model
import tasks
from infra.policy import load_policy
from infra.generation import greedy_accuracy

task = tasks.addition_task(2)
prompt = task.train_prompts[0]
print(f"{len(task.train_prompts)} training prompts, {len(task.eval_prompts)} held out; e.g. {prompt!r}")
print(f"reward of {task.answers[prompt]!r}: {task.reward(prompt, task.answers[prompt])}, "
      f"of '0': {task.reward(prompt, '0')}")

torch.manual_seed(0)
model, tokenizer = load_policy(demo_model.tiny_model(task), lora_r=16)
EVAL_PROMPTS = 50 if SMALL else 500
start_accuracy = greedy_accuracy(model, tokenizer, task.eval_prompts[:EVAL_PROMPTS], task.reward,
                                 max_new_tokens=task.max_new_tokens)
print(f"greedy accuracy on {EVAL_PROMPTS} held-out sums before any RL: {start_accuracy:.3f}")

# %% [markdown]
# ## One round of rollouts
#
# `generate_rollouts` samples G completions for each of P prompts from the current policy (mu,
# for these rollouts) and keeps, with each completion, the behaviour log-prob log mu(o_t) of
# every token, its reward r, and its advantage A = (r - mean r) / (sample std r + 1e-4) within its group
# of G (0 if all G rewards are equal). A group whose answers are all right (or all wrong) has A = 0: it teaches nothing.

# %%
from rollout import generate_rollouts

P, G = (4, 4) if SMALL else (16, 8)          # prompts per round, completions per prompt
R = P * G                                    # new rollouts per round
N = B = 2 * R                                # buffer and batch: each rollout used y = K*B/R = 2 times (K = 1)
C = 2.0                                      # the cap of the importance weight
rng = random.Random(0)
step = 0                                     # optimizer steps so far: the policy version


def new_round():
    model.eval()
    prompts = rng.sample(task.train_prompts, P)
    return generate_rollouts(model, tokenizer, prompts, task.reward, num_generations=G,
                             max_new_tokens=task.max_new_tokens, policy_version=step)


rollouts, stats = new_round()
for i, rollout in enumerate(rollouts[:2 * G]):     # the first two groups
    if i % G == 0:
        print(f"prompt {tokenizer.decode(rollout.prompt_ids)!r}  (answer {task.answers[tokenizer.decode(rollout.prompt_ids)]})")
    print(f"    {tokenizer.decode(rollout.completion_ids, skip_special_tokens=True)!r:8} "
          f"reward {rollout.reward:.0f}  advantage {rollout.advantage:+.3f}  "
          f"log mu of its {len(rollout.behaviour_logp)} tokens {[round(x, 2) for x in rollout.behaviour_logp.tolist()]}")
print(f"round: {R} rollouts, mean reward {stats['reward']:.3f}, groups with A = 0: {stats['zero_adv_frac']:.2f}")

# %% [markdown]
# ## The buffer and its ages
#
# Rollouts go into a FIFO buffer of N; an update samples B of them uniformly and leaves them
# there, so each is used about y = K*B/R times. A rollout's **age** is the number of optimizer
# steps since the policy that sampled it. Here, as in `python train.py`: two rounds fill the
# buffer, the first update trains on fresh data only, and after a third round the buffer holds
# one round from the policy before that update (age 1) and one from the current policy (age 0).

# %%
from buffer import ReplayBuffer
from replay_rl import update_step
from rollout import end_token_ids

eos_ids, pad_id = end_token_ids(model, tokenizer)   # collate refuses tokens after an end token

buffer = ReplayBuffer(N, seed=0)
buffer.add(rollouts)
buffer.add(new_round()[0])
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                              betas=(0.9, 0.99), weight_decay=0.0)
model.eval()   # steps in eval mode, as minimal.py and train.py: no dropout, gradients all the same
first = update_step(model, optimizer, buffer.sample(B), pad_id=pad_id, eos_ids=eos_ids, current_version=step)
step += 1
print(f"update 1, on fresh rollouts only: is_ratio_mean {first['is_ratio_mean']:.6f}, age_max {first['age_max']:.0f}")
buffer.add(new_round()[0])                   # the oldest round leaves (FIFO)
ages = [step - rollout.policy_version for rollout in buffer.items]
print(f"buffer: {len(buffer)} rollouts, ages (oldest first): {ages.count(1)} x 1, then {ages.count(0)} x 0")

# %% [markdown]
# ## One update: importance weights and truncation
#
# The loss sees each token through rho_t = pi_theta(o_t) / mu(o_t): the current policy's
# log-prob (`completion_logp`) against the stored one. On fresh rollouts rho = 1; on the stale
# ones the last update moved it. `policy_loss` weighs each token by w_t = min(rho_t, C), held
# constant: L = - sum_t w_t A log pi_theta(o_t) / (tokens in the batch). `update_step` does the
# same inside and takes the optimizer step.

# %%
from buffer import collate
from replay_rl import completion_logp, policy_loss

sampled = buffer.sample(B)
cols = collate(sampled, pad_id, current_version=step, eos_ids=eos_ids)
with torch.no_grad():
    logp, _ = completion_logp(model, cols)
mask = cols["completion_mask"].bool()
rho = torch.exp(logp - cols["behaviour_logp"])
for age in (0, 1):
    of_age = rho[(cols["age"] == age)[:, None] & mask]
    print(f"age {age}: {of_age.numel()} tokens, rho from {of_age.min():.4f} to {of_age.max():.4f}")
loss, metrics = policy_loss(logp, cols["behaviour_logp"], cols["advantage"], cols["completion_mask"], is_cap=C)
truncated = int((rho[mask] > C).sum())
print(f"weights cut at C = {C}: {truncated} of {int(mask.sum())} tokens "
      f"(is_truncated_frac {metrics['is_truncated_frac']:.4f}); loss {loss:.4f}")
second = update_step(model, optimizer, sampled, pad_id=pad_id, eos_ids=eos_ids, current_version=step)
step += 1
print(f"update 2: is_ratio_mean {second['is_ratio_mean']:.4f}, is_ratio_max {second['is_ratio_max']:.4f}, "
      f"truncated {second['is_truncated_frac']:.4f}, age_mean {second['age_mean']:.2f}")

# %% [markdown]
# ## A short run and its curve
#
# `train.main` runs the whole loop of the README (generate, add to the buffer, K updates,
# evaluate, save) with the same functions, and draws `curves.png` in the run folder: held-out
# accuracy and reward against generated tokens, entropy, importance ratios, ages. The loss is
# not a progress signal (advantages are zero-mean); watch the accuracy and rho.

# %%
import tempfile

from IPython.display import Image, display

import train

if SMALL:
    run_args = ["--max-rounds", "2", "--prompts-per-round", "4", "--num-generations", "4", "--buffer-size", "16",
                "--batch-size", "16", "--eval-every", "1", "--eval-prompts", "20",
                "--output-dir", tempfile.mkdtemp(), "--no-progress"]
else:
    run_args = ["--max-rounds", "60", "--eval-every", "10", "--eval-prompts", "200"]
result = train.main(run_args)
print(f"held-out accuracy {result['first_accuracy']:.3f} -> {result['final_accuracy']:.3f}")
display(Image(filename=os.path.join(result["output_dir"], "curves.png"), width=900))

# %% [markdown]
# ## A real model on GSM8K, on a GPU
#
# The README's command for a 0.5B model, with `--dtype float16`: base weights in fp16, LoRA,
# AdamW and the loss in fp32 (a T4 has no bfloat16). It downloads Qwen2.5-0.5B-Instruct and
# GSM8K from the Hugging Face hub. 30 rounds here; the README's command runs 200.

# %%
if torch.cuda.is_available() and not SMALL:
    gsm8k = train.main(["--model", "Qwen/Qwen2.5-0.5B-Instruct", "--task", "gsm8k", "--dtype", "float16",
                        "--lr", "2e-5", "--prompts-per-round", "8", "--num-generations", "8",
                        "--batch-size", "128", "--buffer-size", "128", "--micro-batch-size", "4",
                        "--gradient-checkpointing", "--eval-prompts", "200", "--eval-every", "10",
                        "--max-rounds", "30"])
    display(Image(filename=os.path.join(gsm8k["output_dir"], "curves.png"), width=900))
else:
    print("skipped: no GPU here (Colab: Runtime > Change runtime type > T4 GPU, then run this cell)")
