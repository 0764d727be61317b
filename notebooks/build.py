"""Write walkthrough.ipynb from its twin walkthrough.py, the source that is reviewed and edited.

    python notebooks/build.py          # after editing notebooks/walkthrough.py

walkthrough.py is in jupytext's "percent" format: '# %%' starts a code cell, '# %% [markdown]' a
markdown cell whose lines are comments. The notebook is written without outputs;
tests/test_notebook.py checks that the committed one is what this script writes.
"""
from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE, NOTEBOOK = os.path.join(HERE, "walkthrough.py"), os.path.join(HERE, "walkthrough.ipynb")


def cells(text: str) -> list[dict]:
    """The cells of a percent-format script, in nbformat 4's layout (no outputs)."""
    out = []
    for chunk in text.split("# %%")[1:]:
        header, _, body = chunk.partition("\n")
        lines = body.strip("\n").split("\n")
        if header.strip() == "[markdown]":
            lines = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines]
            cell = {"cell_type": "markdown", "metadata": {}}
        else:
            cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": []}
        source = "\n".join(lines)
        cell = {"id": f"cell-{len(out)}", **cell, "source": source.splitlines(keepends=True)}
        out.append(cell)
    return out


def notebook(text: str) -> dict:
    return {"cells": cells(text),
            "metadata": {"accelerator": "GPU", "colab": {"provenance": []},
                         "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def render(text: str) -> str:
    return json.dumps(notebook(text), indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    with open(SOURCE) as f:
        rendered = render(f.read())
    with open(NOTEBOOK, "w") as f:
        f.write(rendered)
    print(f"wrote {NOTEBOOK}")
