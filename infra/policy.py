"""Loading the policy: a Hugging Face causal LM (hub id, local folder) with a fresh LoRA adapter,
its tokenizer, 4-bit and gradient checkpointing where asked, dropout off. The method's modules take
the model they are given; this is how train.py, evaluate.py and the tests make one.
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from replay_rl import dropout_rates


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """The model's tokenizer, padding on the left (prompts for generate), with EOS as the pad token
    if it has none."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    # Engineering: AutoTokenizer picks the class from the model type (qwen2 -> Qwen2Tokenizer),
    # which rebuilds the pre-tokenizer: for a folder whose tokenizer.json is not Qwen's own (e.g. a
    # character vocabulary) that silently drops spaces. Then the tokenizer.json exactly as saved is
    # the right one.
    probe = "12 + 3 = 15"
    if tokenizer.decode(tokenizer.encode(probe, add_special_tokens=False)) != probe:
        from transformers import PreTrainedTokenizerFast
        try:
            saved = PreTrainedTokenizerFast.from_pretrained(name_or_path)
        except (OSError, ValueError):
            # no tokenizer.json (e.g. sentencepiece only): keep AutoTokenizer's
            saved = None
        if (saved is not None
                and saved.decode(saved.encode(probe, add_special_tokens=False)) == probe):
            tokenizer = saved
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def dropout_off(model) -> None:
    """Every dropout rate of the model set to 0 (replay_rl.dropout_rates finds them: nn.Dropout's p,
    the float attributes layers pass to F.dropout themselves, and the rates a layer reads from its
    config during the forward, as Falcon's hidden_dropout or GPT-Neo's attention_dropout), so that
    its training forward computes the distribution that sampled: rho = 1 on fresh data."""
    for _, owner, attr, _ in dropout_rates(model):
        setattr(owner, attr, 0.0)


def load_policy(name_or_path: str, *, lora_r: int = 16, lora_alpha: int | None = None,
                target_modules="all-linear", load_in_4bit: bool = False, device: str = "cpu",
                dtype: torch.dtype = torch.float32, gradient_checkpointing: bool = False,
                trust_remote_code: bool = False, tokenizer=None):
    """Load a Hugging Face causal LM (hub id or local folder) and wrap it with a fresh LoRA adapter.

    Returns (peft_model, tokenizer): pi_theta, with only the LoRA weights trainable. For exact
    importance ratios the model samples with only the settings rollout.py passes (the checkpoint's
    own generation defaults are dropped: rollout.py overrides or refuses them anyway) and without
    dropout, so on fresh data rho = 1.
    tokenizer: one from ``load_tokenizer`` (else loaded here). load_in_4bit: nf4 weights with
    double quantization, computing in ``dtype``. lora_alpha: None gives 2 * lora_r, so LoRA's
    scale lora_alpha / lora_r is 2 at any rank; train.py passes its --lora-alpha (default 32, a
    fixed number: scale 2 at its default lora_r 16, another at another rank).
    gradient_checkpointing: recompute activations in backward (less memory, ~30% more time).
    """
    from peft import LoraConfig, get_peft_model

    tokenizer = tokenizer or load_tokenizer(name_or_path, trust_remote_code)
    model = load_base_model(name_or_path, load_in_4bit=load_in_4bit, device=device, dtype=dtype,
                            gradient_checkpointing=gradient_checkpointing,
                            trust_remote_code=trust_remote_code)
    # Sampling must follow only the settings rollout.py passes: a checkpoint's shipped defaults
    # (Qwen-Instruct: repetition_penalty, top_k, temperature) would otherwise fill in the unset
    # fields of generate() and change the distribution behind the stored behaviour log-probs.
    # Only the end tokens are kept.
    model.generation_config = GenerationConfig(eos_token_id=model.generation_config.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    dropout_off(model)      # else the training forward differs from the sampling one (rho != 1)
    lora = LoraConfig(r=lora_r, lora_alpha=2 * lora_r if lora_alpha is None else lora_alpha,
                      lora_dropout=0.0, target_modules=target_modules, task_type="CAUSAL_LM")
    return get_peft_model(model, lora), tokenizer


def load_base_model(name_or_path: str, *, load_in_4bit: bool, device: str, dtype: torch.dtype,
                    gradient_checkpointing: bool, trust_remote_code: bool):
    """The causal LM that load_policy wraps: 4-bit (nf4, prepared for k-bit training) or not, on
    ``device``, with gradient checkpointing if asked."""
    kwargs = dict(dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True)
    if load_in_4bit:
        from transformers import BitsAndBytesConfig
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype)
        kwargs["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if load_in_4bit:
        from peft import prepare_model_for_kbit_training
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
        # Engineering: bitsandbytes on CPU repacks 4-bit weights after a no-grad forward (generate),
        # after which backward silently gives no LoRA gradients; this flag keeps the plain layout.
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    else:
        model.to(device)
        if gradient_checkpointing:
            # Engineering: transformers renamed the method (and its keyword); the old name is
            # deprecated
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            # so checkpointed blocks see a tensor that needs grad
            model.enable_input_require_grads()
    return model
