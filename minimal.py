"""RL post-training with experience replay: the whole method in one file, read top to bottom.

    python minimal.py        # the demo model learns to carry in 2-digit sums (about 25 s, CPU)

It imports torch, transformers, peft and the standard library, and nothing of this repository. The
demo model is a 0.53M-parameter Llama with a character tokenizer. It is loaded with
``from_pretrained`` from the folder demo/. It was trained on sums by a sloppy teacher who forgets
each carry 70% of the time. So it knows how to carry but rarely does: it gets 0.35 of the held-out
sums right. RL with a 0/1 reward for the exact sum teaches it to carry (0.9 or more).

The method ("Efficient RL Training for LLMs with Experience Replay", arXiv 2604.08706). Each round:
  1. Generate G completions for each of P prompts with the current policy pi_theta. The policy as it
     is now is the *behaviour policy* mu of these rollouts. Store log mu(o_t) for every token o_t.
  2. Reward each completion (r), and normalize the rewards within each group of G:
     A = (r - mean r) / (sample std r + 1e-4).
  3. Add the R = P x G rollouts to a FIFO buffer of capacity N. The oldest leave first.
  4. Once the buffer holds B, take K optimizer steps, each on B rollouts drawn uniformly from it.
     They are distinct within a batch and are not removed. So each rollout is used about
     y = K*B/R times (the replay ratio).
By the time a rollout is replayed, pi_theta has moved away from mu. Truncated importance weights
correct for this, per completion token. The weight is held constant (no gradient through it):
    rho_t = pi_theta(o_t) / mu(o_t),   w_t = min(rho_t, C),
    L = - sum_t w_t A log pi_theta(o_t) / (the batch's completion tokens)
On fresh data rho = 1, and this is the plain policy gradient.

Where this file departs from the paper (train.py offers the paper's loss and its workers as flags;
it too trains LoRA adapters, not the full model):
  - The loss. Here it is truncated IS (C = 2). The paper's clipped GRPO objective is train.py
    --loss ppo.
  - The model. Here it is a tiny demo with LoRA adapters, trained by AdamW at lr 1e-3. The paper
    fine-tuned Qwen3-0.6B and larger in full, with Adam at a constant lr of 3.37e-7, batches of
    60, G = 16.
  - Synchronous rounds: generate, then train. In the paper, workers generate while the trainer
    trains (train.py --generators n, async_rl.py).
  - log mu comes from a second, no-grad forward after generate: one more forward over every
    sampled sequence, without a backward. train.py takes it the same way (rollout.forward_log_mu);
    with --record-log-mu it records it while generate samples (infra/generation.py), with no
    second forward.
Each piece below computes what its counterpart in rollout.py, buffer.py or replay_rl.py computes,
on the same inputs (tests/test_minimal.py checks log mu, the advantages, collate's columns, the
loss, its gradient and the step on the demo). The README's table says how their arguments and
returns differ.
"""
import logging
import os
import random
import re
import warnings
from collections import deque
from dataclasses import dataclass

import torch

# peft imports bitsandbytes, which on some CPUs warns that an optional kernel is missing: noise
for library in ("bitsandbytes", "kernels"):
    logging.getLogger(library).setLevel(logging.ERROR)
from peft import LoraConfig, get_peft_model     # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

# Silence a deprecation notice that peft 0.21 triggers in transformers 5 when it wraps the model
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")

MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
P, G = 16, 8                # prompts per round x completions per prompt: R = 128 new rollouts
N, B, K = 256, 256, 1       # buffer capacity, rollouts per step, steps per round: y = K*B/R = 2
C = 2.0                     # the cap of the importance weight
T = 1.0                     # the sampling temperature. mu samples at T, and the loss scores at T
LR = 1e-3                   # AdamW, LoRA weights only
ROUNDS, EVAL_EVERY = 100, 25
MAX_NEW_TOKENS = 5          # a sum of two 2-digit numbers has at most 3 digits, then EOS


# ---- the task: 2-digit sums, a fixed held-out split --------------------------------------------
PAIRS = [(a, b) for a in range(100) for b in range(100)]
random.Random(1234).shuffle(PAIRS)                          # the split of tasks.addition_task
EVAL_PROMPTS = [f"{a}+{b}=" for a, b in PAIRS[:500]]
TRAIN_PROMPTS = [f"{a}+{b}=" for a, b in PAIRS[500:]]


def reward(prompt: str, completion: str) -> float:
    """1 for the exact sum ("37+45=" -> "82"; an integer, spaces around allowed, as train.py's
    reward, tasks.addition_task), else 0. Parsed, never evaluated."""
    a, b = prompt[:-1].split("+")
    number = re.fullmatch(r"\s*(-?\d{1,30})\s*", completion)
    return float(number is not None and int(number.group(1)) == int(a) + int(b))


# ---- a rollout: what travels from generation to the loss ---------------------------------------
@dataclass(eq=False)
class Rollout:
    prompt_ids: torch.Tensor        # [prompt length], no padding
    completion_ids: torch.Tensor    # [completion length], up to and including the first EOS
    behaviour_logp: torch.Tensor    # [completion length], log mu(o_t) at temperature T
    reward: float
    advantage: float                # A, fixed when sampled and never recomputed on replay
    policy_version: int             # optimizer steps taken before sampling, NaN/inf skips included
    temperature: float              # the T it was sampled at. The loss must score it at the same T
    uses: int = 0                   # training batches it has been in


# ---- 1. generating G completions per prompt: log mu, rewards, advantages ----------------------
def end_ids(model, tokenizer) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS, and any the model's generation_config
    lists (a chat model often ends its turn with another token, e.g. Llama-3's <|eot_id|>)."""
    listed = model.generation_config.eos_token_id
    listed = [listed] if isinstance(listed, int) else list(listed or [])
    return sorted({tokenizer.eos_token_id, *listed} - {None})


# the two guards that sampling and the update call
def refuse_training_mode(model) -> None:
    """Refuses a model in training mode, dropout rates 0 or not (the module's functions refuse only
    active dropout). In training mode dropout (nn.Dropout, and the rates that layers pass to
    F.dropout themselves) would make it sample, or score, another function than the one trained on
    (rho != 1 on fresh data). model.eval() turns all of it off. Gradients still flow."""
    if model.training:
        raise ValueError("the model is in training mode, where dropout may act: call model.eval()")


def refuse_acting_settings(model) -> None:
    """Refuses a model whose own generation_config holds a setting that acts whenever it is set.
    generate would apply it, and log mu would not know. These settings are suppressed or forced
    tokens, banned words, a sequence bias, min_p and top_h cuts, a length penalty, a watermark and
    prompt lookup. (A minimum length is not among them: generate_rollouts passes
    min_new_tokens=0, which replaces the model's min_length.)"""
    acting = [name for name in ("suppress_tokens", "begin_suppress_tokens", "bad_words_ids",
                                "sequence_bias", "forced_bos_token_id", "forced_eos_token_id",
                                "min_p", "top_h", "exponential_decay_length_penalty",
                                "watermarking_config", "prompt_lookup_num_tokens")
              if getattr(model.generation_config, name, None)]
    if acting:
        raise ValueError(f"the model's generation_config sets {acting}: generate would sample "
                         "from another distribution than softmax(z / T); unset them")


@torch.no_grad()
def generate_rollouts(model, tokenizer, prompts: list[str], reward_fn, *, num_generations: int,
                      max_new_tokens: int, temperature: float, policy_version: int):
    """Sample G = num_generations completions of each prompt from softmax(z_t / T), T =
    temperature. Returns them as Rollouts with log mu and A (reward_fn(prompt, completion) -> r),
    and the round's figures ({"reward": the mean reward}). The model must be in eval mode, with no
    dropout, so that it samples the function it trains. Prompts are tokenized as written (no
    special tokens added): a model whose tokenizer adds a BOS needs it written in each prompt
    (rollout.generate_rollouts warns when it is missing; this one does not)."""
    G = num_generations
    refuse_training_mode(model)         # the two guards above
    refuse_acting_settings(model)
    enc = tokenizer([p for p in prompts for _ in range(G)], return_tensors="pt", padding=True,
                    padding_side="left", add_special_tokens=False)
    eos = end_ids(model, tokenizer)
    # Each common setting that changes the distribution away from softmax(z_t / T) is set to its
    # neutral value here. generate would fill any setting left unset from the model's own
    # generation_config (an instruct model's repetition_penalty, top_k, top_p), then from its
    # defaults (top_k 50). log mu, taken from softmax(z_t / T) below, would then be of another
    # distribution than the one that drew the token. Settings that act whenever they are set
    # cannot be passed as off, so refuse_acting_settings refuses them.
    config = GenerationConfig(do_sample=True, num_beams=1, temperature=temperature, top_k=0,
                              top_p=1.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
                              repetition_penalty=1.0, no_repeat_ngram_size=0,
                              encoder_repetition_penalty=1.0, encoder_no_repeat_ngram_size=0,
                              min_new_tokens=0, guidance_scale=1.0,
                              max_new_tokens=max_new_tokens, eos_token_id=eos,
                              pad_token_id=tokenizer.pad_token_id)
    sequences = model.generate(**enc, generation_config=config)       # [P*G, prompt_len + new]
    prompt_len = enc.input_ids.shape[1]
    completions = sequences[:, prompt_len:]
    # A completion keeps its tokens up to and including its first end token, or all of them if it
    # has none. After the EOS, generate pads with the pad id, which may equal EOS. So the mask is by
    # position, not by id.
    at_end = torch.isin(completions, torch.tensor(eos))                   # bool [P*G, max_len]
    length = torch.where(at_end.any(1), at_end.int().argmax(1) + 1, completions.shape[1])
    mask = torch.arange(completions.shape[1])[None, :] < length[:, None]      # [P*G, max_len]
    # log mu(o_t) = log softmax(z_t / T)[o_t], where z_t are the logits one position left of o_t.
    # This is one forward more than generate ran. It costs a training forward without the backward.
    attention = torch.cat([enc.attention_mask, mask.long()], 1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)              # as generate numbers them
    logits = model(input_ids=sequences, attention_mask=attention, position_ids=positions).logits
    # column j's logits predict token j + 1, so the columns from prompt_len - 1 to the one before
    # the last score the completion's max_len tokens (completion_logp below: the same columns)
    z = logits[:, prompt_len - 1:-1].float()                        # [P*G, max_len, vocab]
    behaviour_logp = torch.log_softmax(z / temperature, -1).gather(-1, completions[..., None])
    behaviour_logp = behaviour_logp.squeeze(-1)
    # rewards, and advantages within each group of G
    texts = tokenizer.batch_decode(completions.masked_fill(~mask, tokenizer.pad_token_id),
                                   skip_special_tokens=True)
    rewards = torch.tensor([reward_fn(prompts[i // G], text) for i, text in enumerate(texts)])
    if not torch.isfinite(rewards).all():       # a NaN A would poison every step drawing it
        raise ValueError("reward_fn returned a reward that is not finite")
    advantages = group_advantages(rewards, torch.arange(len(texts)) // G)   # i answers i // G
    rollouts = [Rollout(prompt_ids=enc.input_ids[i][enc.attention_mask[i].bool()],
                        completion_ids=completions[i, :length[i]],
                        behaviour_logp=behaviour_logp[i, :length[i]], reward=rewards[i].item(),
                        advantage=advantages[i].item(), policy_version=policy_version,
                        temperature=temperature)
                for i in range(len(texts))]
    return rollouts, {"reward": rewards.mean().item()}


# ---- 2. the group advantages (generate_rollouts, above, calls them) -------------------------
def group_advantages(rewards: torch.Tensor, group: torch.Tensor, std_floor: float = 1e-4):
    """A = (r - mean r) / (std r + std_floor), with the mean and sample std over each group: the
    completions of one prompt. rewards: [n]; group: [n], which prompt each completion answers (any
    ids, any order). A group of equal rewards (or of one) gets exactly 0: it teaches nothing."""
    if group.is_floating_point():
        raise ValueError("group ids must be integers (// G, not / G)")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    advantages = torch.zeros_like(rewards)
    for g in group.unique():
        members = group == g
        r = rewards[members]
        if (r != r[0]).any():
            advantages[members] = (r - r.mean()) / (r.std() + std_floor)
    return advantages


# ---- 3. the replay buffer: FIFO, sampled uniformly ----------------------------------------------
class ReplayBuffer:
    """Up to N rollouts, oldest first. Adding past N evicts the oldest (FIFO). sample(B) draws B
    distinct rollouts uniformly and leaves them in, so each can be drawn again (replay). Here
    B = N. Once the buffer is full, every step takes all of it: this round's 128 and the last
    round's. The draw only permutes them. With B < N a step takes a random subset."""

    def __init__(self, capacity: int, seed: int):
        self.items = deque(maxlen=capacity)     # appending to a full deque drops its oldest
        self.rng = random.Random(seed)

    def add(self, rollouts: list[Rollout]) -> None:
        if len(rollouts) > self.items.maxlen:       # the first would leave before any batch
            raise ValueError(f"{len(rollouts)} rollouts added to a buffer of {self.items.maxlen}")
        self.items.extend(rollouts)

    def sample(self, batch_size: int) -> list[Rollout]:
        """Draw B distinct rollouts uniformly at random. Their use counts go up, and they stay."""
        sampled = self.rng.sample(list(self.items), batch_size)
        for rollout in sampled:
            rollout.uses += 1
        return sampled


# ---- 4. one optimizer step: collate, log pi_theta, the loss --------------------------------------
def collate(rollouts: list[Rollout], pad_id: int, *, eos_ids: list[int]) -> dict:
    """Pad rollouts into one batch. Prompts are left-padded and completions right-padded, so every
    completion starts at the same column:  [pad pad p p p | c c c EOS pad]
    Returns input_ids, attention_mask, position_ids: [batch, prompt_len + max_len].
    completion_mask, behaviour_logp: [batch, max_len]. advantage: [batch].
    eos_ids: the ids that end a completion (end_ids). The mask is 1 on each completion's whole
    length, so a token stored after its first end token would be trained on: it is refused."""
    if any(pad_id in (int(r.prompt_ids[0]), int(r.prompt_ids[-1])) for r in rollouts):
        raise ValueError("a prompt begins or ends with the pad id: store prompts unpadded")
    if any(r.completion_ids[-2:].tolist() == [pad_id, pad_id] for r in rollouts):
        raise ValueError("a completion ends with the pad id twice: trim it after its first EOS")
    if any(torch.isin(r.completion_ids[:-1], torch.tensor(eos_ids)).any() for r in rollouts):
        raise ValueError("a completion has tokens after its first end token: store each "
                         "completion up to and including its first end token, else what "
                         "follows is trained on")
    if any(r.behaviour_logp.shape != r.completion_ids.shape for r in rollouts):
        raise ValueError("behaviour_logp must hold log mu of each completion token")
    if len({r.temperature for r in rollouts}) > 1:
        raise ValueError("rollouts sampled at different temperatures in one batch")
    prompt_len = max(len(r.prompt_ids) for r in rollouts)
    max_len = max(len(r.completion_ids) for r in rollouts)
    n = len(rollouts)
    input_ids = torch.full((n, prompt_len + max_len), pad_id)
    attention_mask = torch.zeros((n, prompt_len + max_len), dtype=torch.long)
    behaviour_logp = torch.zeros((n, max_len))
    for i, r in enumerate(rollouts):
        start, end = prompt_len - len(r.prompt_ids), prompt_len + len(r.completion_ids)
        input_ids[i, start:prompt_len] = r.prompt_ids
        input_ids[i, prompt_len:end] = r.completion_ids
        attention_mask[i, start:end] = 1
        behaviour_logp[i, :len(r.completion_ids)] = r.behaviour_logp
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            # positions count real tokens only, as generate numbered them under left padding
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "completion_mask": attention_mask[:, prompt_len:].float(),
            "behaviour_logp": behaviour_logp,
            "advantage": torch.tensor([r.advantage for r in rollouts]),
            "temperature": rollouts[0].temperature}


def completion_logp(model, cols: dict, temperature: float):
    """log pi_theta(o_t | o_<t) at temperature T for every completion column, with gradient, and
    the policy's entropy there (a metric, no gradient): [batch, max_len] each. The logits at
    column j predict token j + 1. So the completion's tokens are scored by the max_len columns to
    their left. The last column predicts nothing and is not fed."""
    refuse_training_mode(model)
    if cols["temperature"] != temperature:      # log pi_theta at another T than mu's: rho != 1
        raise ValueError(f"the rollouts were sampled at T = {cols['temperature']}, "
                         f"not {temperature}")
    max_len = cols["completion_mask"].shape[1]
    # collate's layout: the completions fill the last max_len columns, padded on the right; each
    # prompt ends in the column before them, padded on the left; positions count real tokens
    attention = cols["attention_mask"]
    if (not torch.equal(attention[:, -max_len:].bool(), cols["completion_mask"] > 0)
            or not attention[:, -max_len - 1].bool().all()
            or not torch.equal(cols["position_ids"], (attention.cumsum(1) - 1).clamp(min=0))):
        raise ValueError("cols not laid out as collate's: build them with collate")
    logits = model(input_ids=cols["input_ids"][:, :-1],
                   attention_mask=cols["attention_mask"][:, :-1],
                   position_ids=cols["position_ids"][:, :-1]).logits[:, -max_len:]
    tokens = cols["input_ids"][:, -max_len:]
    logp = torch.log_softmax(logits.float() / temperature, -1)     # [batch, max_len, vocab]
    with torch.no_grad():                                       # H, a metric: no graph kept
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1), entropy


def policy_loss(logp, behaviour_logp, advantage, mask, *, is_cap: float):
    """L = - sum_t min(rho_t, C) A log pi_theta(o_t) / (the batch's completion tokens), C = is_cap.
    The weight w_t = min(rho_t, C) is held constant. logp, behaviour_logp, mask: [batch, max_len].
    advantage: [batch], one per rollout. A [batch, 1] would broadcast to [batch, batch, max_len].
    Padding is selected away (torch.where), never multiplied by 0, because NaN * 0 is NaN."""
    if advantage.shape != logp.shape[:1]:
        raise ValueError(f"advantage {list(advantage.shape)}: one per rollout, [batch]")
    if behaviour_logp.shape != logp.shape or mask.shape != logp.shape:     # else they broadcast
        raise ValueError("logp, behaviour_logp and mask must each be [batch, max_len]")
    if is_cap < 1:                  # a cap below 1 would cut fresh tokens (rho = 1) too
        raise ValueError(f"is_cap {is_cap}: C must be >= 1")
    real = mask > 0
    logp = torch.where(real, logp, 0.0)
    rho = torch.exp(logp - torch.where(real, behaviour_logp, 0.0)).detach()    # no gradient
    w = rho.clamp(max=is_cap)
    per_token = torch.where(real, -w * advantage.detach()[:, None] * logp, 0.0)   # A: a constant
    tokens = mask.sum().clamp(min=1)
    metrics = {"is_ratio_mean": torch.where(real, rho, 0.0).sum().item() / tokens.item(),
               "is_truncated_frac": (real & (rho > is_cap)).sum().item() / tokens.item()}
    return per_token.sum() / tokens, metrics


def update(model, optimizer, rollouts: list[Rollout], pad_id: int, temperature: float,
           is_cap: float, *, eos_ids: list[int]) -> dict:
    """One step: the loss of the batch, backward, then the gradient clipped at norm 1. The clip is
    a guard against a rare huge step, not part of the method. The step is skipped if the loss or
    gradient is NaN/inf, which would poison the weights and AdamW's moments for good."""
    refuse_training_mode(model)
    cols = collate(rollouts, pad_id, eos_ids=eos_ids)
    logp, _ = completion_logp(model, cols, temperature)
    loss, metrics = policy_loss(logp, cols["behaviour_logp"], cols["advantage"],
                                cols["completion_mask"], is_cap=is_cap)
    optimizer.zero_grad()
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    skipped = not (torch.isfinite(loss) and torch.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
    return {"loss": loss.item(), "skipped": int(skipped), **metrics}


# ---- the eval: greedy accuracy on held-out prompts ------------------------------------------
@torch.no_grad()
def evaluate(model, tokenizer, prompts: list[str], reward_fn, max_new_tokens: int) -> float:
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                    add_special_tokens=False)
    # the argmax of z_t, with a model's own penalties (an instruct model's repetition_penalty) off
    config = GenerationConfig(do_sample=False, num_beams=1, repetition_penalty=1.0,
                              no_repeat_ngram_size=0, min_new_tokens=0, guidance_scale=1.0,
                              max_new_tokens=max_new_tokens, eos_token_id=end_ids(model, tokenizer),
                              pad_token_id=tokenizer.pad_token_id)
    completions = model.generate(**enc, generation_config=config)[:, enc.input_ids.shape[1]:]
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    return sum(reward_fn(p, t) for p, t in zip(prompts, texts)) / len(prompts)


# ---- the loop -------------------------------------------------------------------------------
def main(rounds: int = ROUNDS, eval_every: int = EVAL_EVERY, eval_prompts: int = 500,
         seed: int = 0, log=print) -> list[float]:
    """Train the demo model. Returns the held-out greedy accuracy before any step, every
    eval_every rounds, and at the end."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    base = AutoModelForCausalLM.from_pretrained(MODEL)
    # pi_theta: the base model with LoRA adapters on every linear layer. Only the adapters train.
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                            target_modules="all-linear", task_type="CAUSAL_LM"))
    # The model stays in eval mode throughout, training included. Dropout is then off, so the
    # function trained is the one that sampled (else rho != 1 even on fresh data). Gradients flow
    # in eval mode all the same.
    model.eval()
    # beta2 = 0.99, so the second moment follows the gradient's scale within ~100 steps as the
    # policy moves. No weight decay, which would pull the adapter back to the base model.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                  betas=(0.9, 0.99), weight_decay=0.0)
    buffer, step = ReplayBuffer(N, seed), 0
    eos_ids = end_ids(model, tokenizer)             # the ids that end a completion
    accuracy = [evaluate(model, tokenizer, EVAL_PROMPTS[:eval_prompts], reward, MAX_NEW_TOKENS)]
    log(f"round 0: held-out accuracy {accuracy[-1]:.3f}")
    for round_ in range(1, rounds + 1):
        prompts = rng.sample(TRAIN_PROMPTS, P)
        rollouts, figures = generate_rollouts(model, tokenizer, prompts, reward,
                                              num_generations=G, max_new_tokens=MAX_NEW_TOKENS,
                                              temperature=T, policy_version=step)
        buffer.add(rollouts)                            # FIFO: past N, the oldest leave
        if len(buffer.items) >= B:                      # K steps, once the buffer holds B
            for _ in range(K):
                sampled = buffer.sample(B)
                ages = [step - rollout.policy_version for rollout in sampled]
                metrics = update(model, optimizer, sampled, tokenizer.pad_token_id, T, C,
                                 eos_ids=eos_ids)
                step += 1                               # the version: steps taken, skipped too
        if round_ % 10 == 0 and step:
            log(f"round {round_}: reward {figures['reward']:.2f}, is_ratio_mean "
                f"{metrics['is_ratio_mean']:.4f}, weights cut at C "
                f"{metrics['is_truncated_frac']:.3f}, mean age {sum(ages) / len(ages):.1f} steps")
        if round_ % eval_every == 0 or round_ == rounds:
            accuracy.append(evaluate(model, tokenizer, EVAL_PROMPTS[:eval_prompts], reward,
                                     MAX_NEW_TOKENS))
            log(f"round {round_}: held-out accuracy {accuracy[-1]:.3f}")
    return accuracy


if __name__ == "__main__":
    main()
