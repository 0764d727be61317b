import os
import random
import re

import pytest

from infra import demo_model
import tasks


def test_sloppy_teacher_drops_carries_by_hand():
    rng = random.Random(0)
    assert demo_model.sloppy_sum("37+45=", 1.0, rng) == "72"          # the carry into the tens forgotten
    assert demo_model.sloppy_sum("99+99=", 1.0, rng) == "88"          # both carries, the hundreds digit too
    assert demo_model.sloppy_sum("5+5=", 1.0, rng) == "0"
    assert demo_model.sloppy_sum("12+34=", 1.0, rng) == "46"          # no carry: nothing to forget
    assert demo_model.sloppy_sum("99+99=", 0.0, rng) == "198"


def test_sloppy_teacher_is_right_as_often_as_it_keeps_every_carry(addition):
    rng = random.Random(1)
    assert all(demo_model.sloppy_sum(p, 0.0, rng) == addition.answers[p] for p in addition.train_prompts[:2000])
    right = sum(demo_model.sloppy_sum("37+45=", 0.7, rng) == "82" for _ in range(20_000)) / 20_000
    assert right == pytest.approx(0.3, abs=0.015)                 # one carry, kept with probability 0.3
    both = sum(demo_model.sloppy_sum("99+99=", 0.7, rng) == "198" for _ in range(20_000)) / 20_000
    assert both == pytest.approx(0.09, abs=0.01)                  # two carries: 0.3 * 0.3


@pytest.mark.parametrize("name", ["addition", "columns"])
def test_shipped_weights_are_the_default_model_and_load_without_a_warm_start(name, tmp_path, monkeypatch):
    """Each shipped file holds its task's default spec (a changed WARM_START without --rebuild fails
    here), an empty cache gets it without training, and its accuracy is the one the docs state."""
    from safetensors import safe_open
    task = tasks.load_task(name)
    with safe_open(demo_model.SHIPPED[task.name], "pt") as f:
        assert f.metadata()["spec"] == demo_model.spec(task)
    monkeypatch.setenv("REPLAY_RL_CACHE", str(tmp_path))
    monkeypatch.setattr(demo_model, "warm_start", lambda *a, **k: pytest.fail("built instead of loaded"))
    path = demo_model.tiny_model(task)
    accuracy = demo_model.held_out_accuracy(path, task)
    assert accuracy == pytest.approx(demo_model.SHIPPED_ACCURACY[task.name], abs=0.01)
    stated = f"{demo_model.SHIPPED_ACCURACY[task.name]:.3f}"        # the README's quick start, the usage guide's task
    assert stated in open(os.path.join(demo_model.HERE, "..", "docs", "usage.md")).read()
    if name == "addition":
        assert stated in open(os.path.join(demo_model.HERE, "..", "README.md")).read()


def test_other_seeds_are_built_and_cached_apart(addition, tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAY_RL_CACHE", str(tmp_path))
    built = []
    monkeypatch.setattr(demo_model, "warm_start", lambda task, steps, seed, log: built.append(seed) or (
        demo_model.new_model(), demo_model.char_tokenizer()))
    first = demo_model.tiny_model(addition, seed=1, log=lambda *a: None)
    assert built == [1] and demo_model.tiny_model(addition, seed=1) == first          # cached: built once
    assert demo_model.tiny_model(addition) != first and built == [1]                  # seed 0: the shipped file
    assert re.fullmatch(r"tiny-addition2-[0-9a-f]{10}", first.rsplit("/", 1)[1])
