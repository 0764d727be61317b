"""--dtype auto on a CPU with bfloat16 units (issue 68, item 2): float32, and the start-up says why,
with the figures benchmarks/bf16_cpu.py measured (docs/results/bf16_cpu.json)."""
import json
import os

import pytest
import torch

from infra import loading

FLAGS = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
HAS_BF16 = "avx512_bf16" in FLAGS or "amx_bf16" in FLAGS


def test_the_committed_measurement_says_bfloat16_misses_the_bar_and_float32_meets_it():
    found = json.load(open(loading.BF16_CPU_RESULT))
    assert found["bar_abs_log_rho"] == 1e-3
    assert found["float32"]["within_bar"] and found["float32"]["abs_log_rho_max"] <= 1e-3
    assert not found["bfloat16"]["within_bar"] and found["bfloat16"]["abs_log_rho_max"] > 1e-3
    assert found["bfloat16"]["tokens"] > 100 and found["float32"]["tokens"] > 100


@pytest.mark.skipif(not HAS_BF16, reason="this CPU has no bfloat16 units")
def test_auto_keeps_float32_on_this_cpu_and_says_why_with_the_measured_figures():
    found = json.load(open(loading.BF16_CPU_RESULT))
    assert loading.pick_dtype("auto", "cpu") is torch.float32
    note = loading.cpu_bfloat16_note("auto", "cpu")
    assert note.startswith("float32, though this CPU has bfloat16 units")
    assert f"{found['bfloat16']['abs_log_rho_mean']:.2g}" in note
    assert "--dtype bfloat16 uses them anyway" in note


def test_no_note_where_nothing_was_chosen_for_the_user():
    assert loading.cpu_bfloat16_note("float32", "cpu") == ""
    assert loading.cpu_bfloat16_note("bfloat16", "cpu") == ""
    assert loading.cpu_bfloat16_note("auto", "cuda") == ""
    assert loading.pick_dtype("bfloat16", "cpu") is torch.bfloat16
