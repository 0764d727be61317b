"""completion_logp with each distinct prompt run once: the shared-prefix forward of the update.

Each group of G rollouts carries the same prompt, and the plain forward (replay_rl.completion_logp)
runs it once per rollout. Here every distinct prompt of the batch runs once, with the KV cache on;
its keys and values are then copied to the rows that share it (index_select: the gradient of the
copies sums back into the one prompt forward), and the completion columns run against them:

    plain:          batch x (Lp + max_len - 1) token columns through the model
    shared prefix:  prompts x Lp  +  batch x (max_len - 1)

Lp: the batch's prompt columns (collate's prompt_len, its longest prompt; not the README's P,
prompts a round), prompts: the distinct ones among them. At
SmolLM2's settings (Lp = 47, max_len = 48), a batch of 4 groups of G = 4: 4 x 47 + 16 x 47 = 940
columns instead of 16 x 94 = 1,504 (0.63x); one group of G = 16: 47 + 16 x 47 = 799 instead of
1,504 (0.53x). Attention still reads every prompt key from every completion row; the saving is the
prompt's matmuls (projections, MLP) and their backward.

The same function, up to float rounding: each token sits at the same position with the same mask
(collate's position_ids, the full attention_mask), and under the causal mask a prompt column's keys
and values do not depend on what follows it. The prompt's last column gives the logits of the first
completion token, the completion columns but the last those of the others, as in completion_logp.
What rounds differently: the prompt forward's attention sums over Lp key columns, the plain
one's over Lp + max_len - 1 (masked ones included). tests/test_shared_prefix.py holds it to
completion_logp (log pi_theta, rho on fresh data, the LoRA gradient) in float32 and float64.

Only the rows of one forward share: update_step_engineered's micro-batches each run their own, so
a group split over two micro-batches runs its prompt twice. A batch whose prompts are all distinct
gets completion_logp itself (the same columns, in one forward). Refused, in one line: a model that
checkpoints its layers in training mode with gradients on (there transformers turns the cache off;
a cache written inside a checkpointed layer would be written again when backward recomputes it),
and one whose cache is not a plain DynamicCache of one keys/values tensor per layer (a sliding
window, linear attention, a quantized cache): completion_logp serves those. 4-bit (nf4) base
weights and update_step_engineered's micro-batches: tested, the same values.
"""
from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from replay_rl import check_layout, check_temperature, completion_logp, refuse_active_dropout


def shared_prefix_logp(model, cols: dict[str, torch.Tensor], temperature: float = 1.0,
                       chunk: int = 0):
    """completion_logp's (logp [batch, max_len] with gradient, entropy [batch, max_len] without),
    each distinct prompt of ``cols`` (collate's layout) run once (the module docstring).
    chunk > 0 (train.py's --logp-chunk): the head and the log-softmax as in
    chunked_completion_logp, ``chunk`` real tokens at a time, from the decoder's hidden states;
    a model chunked_completion_logp would not chunk gets the whole logits, as with chunk 0.

    Rows share a prompt when their prompt columns (ids and attention mask, the first Lp columns) are
    equal. For the prompts u = 0 .. U-1, row_of_prompt [U] and prompt_of_row [batch]:
      1. prompt forward, [U, Lp], use_cache: the logits of column Lp - 1 score o_1; each layer's
         keys and values [U, heads, Lp, dim] stay in the cache, with their graph;
      2. those keys and values index_select-ed by prompt_of_row: [batch, heads, Lp, dim];
      3. completion forward, input_ids[:, Lp:-1] [batch, max_len - 1] at collate's position_ids,
         attention_mask all Lp + max_len - 1 columns: its logits score o_2 .. o_max_len;
      4. z = [prompt logits of each row's prompt, completion logits], [batch, max_len, vocab],
         and completion_logp's arithmetic: log softmax(z / T)[o_t], the entropy without gradient.
    """
    check_temperature(cols, temperature)
    check_layout(cols)
    refuse_active_dropout(model)
    refuse_checkpointing(model)
    input_ids, mask, position = cols["input_ids"], cols["attention_mask"], cols["position_ids"]
    max_len = cols["completion_mask"].shape[1]
    Lp = input_ids.shape[1] - max_len
    prompt_of_row, row_of_prompt = distinct_prompts(input_ids[:, :Lp], mask[:, :Lp])
    if len(row_of_prompt) == len(prompt_of_row):           # nothing shared: the plain forward
        return completion_logp(model, cols, temperature)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if chunk and plain_head(base):
        return chunked(base, cols, temperature, chunk, Lp, prompt_of_row, row_of_prompt)
    # transformers renamed the forward's cache argument (past_key_values -> cache) during 5.x
    keyword = ("cache" if "cache" in inspect.signature(base.forward).parameters
               else "past_key_values")
    prompts = DynamicCache(config=base.config)
    out = model(input_ids=input_ids[row_of_prompt, :Lp], attention_mask=mask[row_of_prompt, :Lp],
                position_ids=position[row_of_prompt, :Lp], use_cache=True, logits_to_keep=1,
                **{keyword: prompts})
    z = [out.logits.index_select(0, prompt_of_row)]          # [batch, 1, vocab]: scores o_1
    if max_len > 1:
        rows = expand_rows(prompts, prompt_of_row, Lp, DynamicCache(config=base.config))
        out = model(input_ids=input_ids[:, Lp:-1], attention_mask=mask[:, :-1],
                    position_ids=position[:, Lp:-1], use_cache=True, **{keyword: rows})
        z.append(out.logits)                                 # [batch, max_len - 1, vocab]
    z = torch.cat(z, dim=1).float()                          # [batch, max_len, vocab]
    # from here on completion_logp's lines
    scaled = z / temperature if temperature != 1.0 else z
    tokens = input_ids[:, -max_len:]
    log_sum_exp = torch.logsumexp(scaled, dim=-1)            # [batch, max_len]
    logp = scaled.gather(-1, tokens[..., None]).squeeze(-1) - log_sum_exp
    with torch.no_grad():
        entropy = log_sum_exp - torch.einsum("bcv,bcv->bc", torch.softmax(scaled, -1), scaled)
    return logp, entropy


def plain_head(causal_lm) -> bool:
    """Whether chunked_completion_logp would chunk this model: its logits are a frozen
    torch.nn.Linear lm_head of the hidden states and nothing more (PLAIN_HEAD_MODELS)."""
    from infra.engineered_update import PLAIN_HEAD_MODELS
    head = causal_lm.get_output_embeddings()
    return (getattr(causal_lm.config, "model_type", None) in PLAIN_HEAD_MODELS
            and type(head) is torch.nn.Linear
            and not any(p.requires_grad for p in head.parameters()))


def chunked(causal_lm, cols: dict[str, torch.Tensor], temperature: float, chunk: int, Lp: int,
            prompt_of_row: torch.Tensor, row_of_prompt: torch.Tensor):
    """shared_prefix_logp's steps 1-3 through the decoder alone (the model without its lm_head):
    the hidden states that score o_1 .. o_max_len, [batch, max_len, hidden]; then the head and
    the log-softmax of the real tokens, ``chunk`` at a time (engineered_update._HeadLogp), as
    chunked_completion_logp does. Padding: logp and entropy 0 there."""
    from infra.engineered_update import _HeadLogp
    input_ids, mask, position = cols["input_ids"], cols["attention_mask"], cols["position_ids"]
    max_len = cols["completion_mask"].shape[1]
    decoder = causal_lm.get_decoder()
    keyword = ("cache" if "cache" in inspect.signature(decoder.forward).parameters
               else "past_key_values")
    prompts = DynamicCache(config=causal_lm.config)
    out = decoder(input_ids=input_ids[row_of_prompt, :Lp], attention_mask=mask[row_of_prompt, :Lp],
                  position_ids=position[row_of_prompt, :Lp], use_cache=True,
                  **{keyword: prompts})
    hidden = [out.last_hidden_state[:, -1:].index_select(0, prompt_of_row)]  # scores o_1
    if max_len > 1:
        rows = expand_rows(prompts, prompt_of_row, Lp, DynamicCache(config=causal_lm.config))
        out = decoder(input_ids=input_ids[:, Lp:-1], attention_mask=mask[:, :-1],
                      position_ids=position[:, Lp:-1], use_cache=True, **{keyword: rows})
        hidden.append(out.last_hidden_state)                 # scores o_2 .. o_max_len
    hidden = torch.cat(hidden, dim=1)                        # [batch, max_len, hidden]
    real = cols["completion_mask"].bool()
    head = causal_lm.get_output_embeddings()
    logp, entropy = _HeadLogp.apply(hidden[real], head.weight, head.bias,
                                    input_ids[:, -max_len:][real], temperature, chunk)
    zeros = torch.zeros(real.shape, device=logp.device)
    return zeros.masked_scatter(real, logp), zeros.masked_scatter(real, entropy)


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
    """(prompt_of_row [batch], row_of_prompt [U]): for each row the index of its prompt among the
    U distinct (ids, mask) rows of the prompt columns, in the order they first appear; for each
    distinct prompt its first row."""
    keys = [tuple(row) for row in torch.cat([prompt_ids, prompt_mask], dim=1).tolist()]
    index: dict[tuple, int] = {}
    prompt_of_row = [index.setdefault(key, len(index)) for key in keys]
    row_of_prompt = [keys.index(key) for key in index]
    as_tensor = lambda rows: torch.tensor(rows, device=prompt_ids.device)      # noqa: E731
    return as_tensor(prompt_of_row), as_tensor(row_of_prompt)


def expand_rows(cache, prompt_of_row: torch.Tensor, Lp: int, into):
    """``into`` (an empty DynamicCache) given each layer's keys and values [U, heads, Lp, dim] of
    ``cache`` at the rows prompt_of_row: [batch, heads, Lp, dim]. index_select's backward adds each
    row's gradient into its prompt's. Refuses a cache that is not one plain DynamicLayer per layer
    holding the Lp prompt columns."""
    layers = getattr(cache, "layers", None) or []
    held = sorted({(type(layer).__name__, getattr(layer, "get_seq_length", lambda: None)())
                   for layer in layers}, key=str)
    if held != [("DynamicLayer", Lp)]:
        raise ValueError(f"shared_prefix_logp needs a cache of plain keys/values per layer, each "
                         f"holding the {Lp} prompt columns; this model's layers hold {held} "
                         "(layer kind, columns: a sliding window, linear attention, no cache): "
                         "use completion_logp")
    for index, layer in enumerate(layers):
        into.update(layer.keys.index_select(0, prompt_of_row),
                    layer.values.index_select(0, prompt_of_row), index)
    return into


def refuse_checkpointing(model) -> None:
    """Refuses gradient checkpointing in training mode with gradients on: there transformers turns
    the cache off (and a cache written inside a checkpointed layer would be written again when
    backward recomputes the layer). In eval mode, or under no_grad, nothing is checkpointed."""
    if torch.is_grad_enabled() and any(getattr(module, "gradient_checkpointing", False)
                                       and module.training for module in model.modules()):
        raise ValueError("shared_prefix_logp: gradient checkpointing in training mode turns the "
                         "KV cache off, so the prompts cannot be run once; use completion_logp "
                         "(or model.eval(), if nothing in the model needs training mode)")
