"""notebooks/walkthrough.ipynb: built from its .py twin, committed without outputs, and run top to
bottom on CPU with the small settings (REPLAY_RL_NOTEBOOK_SMALL=1), its teaching cells checked."""
import importlib.util
import json
import os

import pytest
import torch

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
spec = importlib.util.spec_from_file_location("notebook_build", os.path.join(NOTEBOOKS, "build.py"))
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)


def test_committed_notebook_is_its_py_twin_built_without_outputs():
    with open(build.SOURCE) as f:
        expected = build.render(f.read())
    with open(build.NOTEBOOK) as f:
        committed = f.read()
    assert committed == expected, "notebooks/walkthrough.ipynb is stale: run python notebooks/build.py"
    cells = json.loads(committed)["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    setup = "".join(code[0]["source"])
    assert "REPO_URL = " in setup and "google.colab" in setup and '!= "torch"' in setup


@pytest.mark.slow
def test_notebook_runs_top_to_bottom_on_cpu(tmp_path, tiny_path, optional, monkeypatch):
    """Each teaching cell's figures, read back through a cell appended for the test, against
    what they must be: group advantages by hand, ages after the third round, rho = 1 on fresh
    rollouts and not on stale ones, the truncated count, the short run's files."""
    nbformat = optional("nbformat", "the notebook test")
    nbclient = optional("nbclient", "the notebook test")
    optional("ipykernel", "the notebook test")
    monkeypatch.setenv("REPLAY_RL_NOTEBOOK_SMALL", "1")
    nb = nbformat.read(build.NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    out = tmp_path / "figures.json"
    nb.cells.append(nbformat.v4.new_code_cell(f"""
import json
json.dump({{"G": G, "C": C, "step": step, "ages": ages, "rewards": [r.reward for r in rollouts],
           "advantages": [r.advantage for r in rollouts], "rho": rho.tolist(), "mask": mask.tolist(),
           "age": cols["age"].tolist(), "truncated": truncated, "logp": logp.tolist(),
           "behaviour_logp": cols["behaviour_logp"].tolist(), "advantage": cols["advantage"].tolist(), "truncated_frac": float(metrics["is_truncated_frac"]),
           "first_ratio": first["is_ratio_mean"], "run": result["output_dir"]}}, open({str(out)!r}, "w"))"""))
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": NOTEBOOKS}}).execute()
    f = json.load(open(out))
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))

    G = f["G"]
    rewards = torch.tensor(f["rewards"]).view(-1, G)
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)
    expected = torch.where(std > 0, (rewards - mean) / (std + 1e-4), torch.zeros_like(rewards)).view(-1)
    assert torch.allclose(torch.tensor(f["advantages"]), expected, atol=1e-5)
    assert "advantage" in text and "prompt '" in text                     # the rollouts shown as text
    R = rewards.numel()
    assert f["step"] == 2 and f["ages"] == [1] * R + [0] * R                # one stale round, one fresh
    assert f["first_ratio"] == pytest.approx(1.0, abs=1e-5)                 # update 1: fresh data only
    rho, mask = torch.tensor(f["rho"]), torch.tensor(f["mask"])
    age = torch.tensor(f["age"])[:, None].expand_as(rho)
    fresh, stale = rho[mask & (age == 0)], rho[mask & (age == 1)]
    assert (fresh - 1).abs().max() < 1e-4 < (stale - 1).abs().max()         # the update moved pi_theta
    assert f["truncated"] == int((rho[mask] > f["C"]).sum())
    assert f["truncated_frac"] == pytest.approx(f["truncated"] / int(mask.sum()))
    # the truncation count of policy_loss on the notebook's batch, at its cap and at one that bites (C = 1:
    # every stale token whose probability rose)
    from replay_rl import policy_loss
    logp, behaviour = torch.tensor(f["logp"]), torch.tensor(f["behaviour_logp"])
    assert int((rho[mask] > 1.0).sum()) > 0
    for cap in (f["C"], 1.0):
        _, m = policy_loss(logp, behaviour, torch.tensor(f["advantage"]), mask.float(), is_cap=cap)
        assert float(m["is_truncated_frac"]) == pytest.approx(int((rho[mask] > cap).sum()) / int(mask.sum()))
    run = f["run"]
    lines = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [line["round"] for line in lines if "eval_accuracy" in line] == [0, 1, 2]
    assert os.path.getsize(os.path.join(run, "curves.png")) > 10_000
    assert "skipped: no GPU here" in text
