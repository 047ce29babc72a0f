"""Colab only: save the running notebook to a file, so that the checker can test all of it (`pytest --impl`).

On Colab the notebook lives in the browser (and in Drive), not on the runtime's disk where pytest runs, so there is
no file to pass to `--impl`. `save_notebook` asks the browser for the notebook, through Colab's own (private,
undocumented) `google.colab._message` channel, and writes it where you say:

    from utils.colab import save_notebook
    save_notebook("/content/rlhf-course/part0_warmup_mine.ipynb")
    !cd /content/rlhf-course && python -m pytest tests/part0_warmup --impl part0_warmup_mine.ipynb

Untested outside Colab: the test suite checks only what this module does with the reply (tests/test_colab.py uses
a stand-in for Colab). If Colab changes that channel, File > Download > Download .ipynb, upload the file to the
runtime (the folder icon on the left) and pass its path to `--impl` instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from utils.checker.layout import part_of


def save_notebook(path: str | Path) -> Path:
    """Write the Colab notebook this runs in to `path` (a name containing its part, e.g. part0_warmup_mine.ipynb,
    so that the checker knows which part's tests it is for). Returns the path written."""
    path = Path(path)
    if part_of(str(path)) is None or path.suffix != ".ipynb":
        raise ValueError(f"{path.name!r}: name the file after its part and end it in .ipynb (e.g. "
                         "'part0_warmup_mine.ipynb'): the checker reads which part's tests to run from the name.")
    try:
        from google.colab import _message
    except ImportError:
        raise RuntimeError("save_notebook works only on Colab. Elsewhere, save the notebook (Ctrl+S) and pass its "
                           "path to --impl.") from None
    reply = _message.blocking_request("get_ipynb", timeout_sec=30)
    if not isinstance(reply, dict) or "ipynb" not in reply:
        raise RuntimeError(f"Colab did not hand over the notebook (it replied {reply!r:.200}). Use File > Download > "
                           "Download .ipynb, upload the file to the runtime, and pass its path to --impl.")
    notebook = reply["ipynb"]
    tags = {tag for cell in notebook.get("cells", []) for tag in cell.get("metadata", {}).get("tags", [])}
    if "setup" not in tags:
        print("Warning: no cell of this notebook is tagged 'setup' (a copy that lost its cells' tags?), so the "
              "checker will run only the cells that merely import or define things. If the tests cannot find your "
              "functions, start again from the course's notebook (the badge in README.md).")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    print(f"saved {path}; test it with: python -m pytest tests/{part_of(str(path))} --impl {path}")
    return path
