"""docs/usage.md's figures of issue 68 (the shared-prefix update, the step against TRL, the decode's
split, bfloat16 on the CPU) are those of the committed JSON, recomputed here."""
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def results(name):
    return json.load(open(os.path.join(ROOT, "docs", "results", name)))


def usage():
    return " ".join(open(os.path.join(ROOT, "docs", "usage.md")).read().split())


def test_the_shared_prefix_update_figures():
    found, text = results("shared_prefix_cpu.json"), usage()
    u = found["update"]
    for batch in ("G4", "G16", "G4_drawn"):
        assert u[batch]["process_cpu_over_wall"] > 0.95                # nothing else on its core
        shared_chunked = u[batch]["shared_chunked_over_plain_cpu"]
        assert f"{shared_chunked:.2f}x" in text and f"({1 / shared_chunked:.2f}x as fast)" in text
        for key in ("shared_over_plain_cpu", "shared_chunked_over_chunked_cpu"):
            assert f"{u[batch][key]:.2f}x" in text, (batch, key)
    assert f"{found['sharing']['smollm2']['distinct_prompts_mean']:.1f} distinct prompts" in text
    assert (f"{u['G4']['columns_ratio']:.3f}x, {u['G16']['columns_ratio']:.2f}x and "
            f"{u['G4_drawn']['columns_ratio']:.2f}x") in text


def test_the_step_against_trl_and_the_decode_split():
    trl, decode = results("shared_prefix_trl_cpu.json")["trl"], results("decode_cpu.json")
    text = usage()
    assert trl["load_note"] == "cores quiet (nothing else ran)"
    assert (f"took {trl['train_py_shared_over_trl_wall']:.2f}x the seconds of TRL's GRPOTrainer's, "
            f"{trl['train_py_shared_prefix_over_trl_wall']:.2f}x with `--shared-prefix`") in text
    seconds = [trl[k]["wall_s_per_step"] for k in ("train_py_shared", "train_py_shared_prefix",
                                                     "trl_grpo")]
    assert "({:.1f} s, {:.1f} s and {:.1f} s a step".format(*seconds) in text
    rounds = decode["rounds"]
    matmul = sum(r["matmul_s"] for r in rounds) / sum(r["wall_s"] for r in rounds)
    assert round(matmul, 3) == decode["matmul_share_of_unprofiled_round"]
    assert decode["cpu_over_wall"] > 0.95
    assert f"the matmul kernels are {matmul:.0%} of it" in text
    assert f"at most the other {1 - matmul:.0%}" in text
    loop = results("decode_loop_cpu.json")
    median = loop["median_cpu_s"]
    assert loop["generate_overhead"] == round(1 - median["bare"] / median["generate"], 3) < 0.2
    assert "cores quiet" in loop["note"] and loop["settings"]["threads"] == 1
    assert (f"is {loop['generate_overhead']:.1%}: the same\n48 decode steps".replace("\n", " ")
            in text), loop["generate_overhead"]
    assert (f"took {median['generate']:.2f} CPU s through `generate` and {median['bare']:.2f} s"
            in text)


def test_the_bfloat16_figures():
    found, text = results("bf16_cpu.json"), usage()
    assert found["load"]["cpu_over_wall"] > 0.95
    b, f = found["bfloat16"], found["float32"]
    assert (f"mean |log rho| {b['abs_log_rho_mean']:.2g} and up to "
            f"{b['abs_log_rho_max']:.2g}") in text
    assert f"against {f['abs_log_rho_mean']:.0e} and {f['abs_log_rho_max']:.0e}".replace(
        "e-06", "e-6").replace("e-05", "e-5") in text
    assert f"a round took {found['bfloat16_over_float32_generation_s']:.2f}x" in text
    assert f"an update {found['bfloat16_over_float32_step_s']:.2f}x" in text
