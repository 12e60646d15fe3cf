"""A fake coding agent, run like `claude -p PROMPT` in the checkout it is given.

The prompt is the last argument, or `@PATH` to read it from a file (the
`{prompt_file}` form). FAKE_AGENT_MODE says what it does:

* edit: lowers LR, commits that in its checkout, makes a branch and a tag there, tries
  to push (there is no remote), then leaves one more uncommitted change;
* crash: an edit that makes the training script crash (LR lowered, MODE = "crash");
  asked to repair ("# Repair: trial" in the prompt), it restores MODE and keeps LR;
* protected: edits program.md;
* sleep: starts a child process and sleeps (for the timeout);
* fail: exits with status 3; nothing: changes nothing.

FAKE_AGENT_OUT, if set, receives the prompt (and FAKE_AGENT_OUT.pid the sleeping
child's pid). It prints its commit's sha as `COMMIT <sha>` and ends with DESCRIPTION.
"""

import os
import subprocess
import sys
import time
from pathlib import Path


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], capture_output=True, text=True)


def main() -> None:
    prompt = sys.argv[-1]
    if prompt.startswith("@"):
        prompt = Path(prompt[1:]).read_text()
    out = os.environ.get("FAKE_AGENT_OUT")
    if out:
        Path(out).write_text(prompt)
    mode = os.environ.get("FAKE_AGENT_MODE", "edit")
    print(f"fake agent ({mode}) read a prompt of {len(prompt)} characters", flush=True)
    train = Path("train.py")
    text = train.read_text()
    if "# Repair: trial" in prompt:
        train.write_text(text.replace('MODE = "crash"', 'MODE = "ok"'))
        print("DESCRIPTION: restore the mode")
        return
    if mode == "sleep":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        if out:
            Path(out + ".pid").write_text(str(child.pid))
        time.sleep(600)
    if mode == "fail":
        print("error: the model is overloaded", flush=True)
        sys.exit(3)
    if mode == "nothing":
        print("DESCRIPTION: nothing worth changing")
        return
    if mode == "protected":
        Path("program.md").write_text("# the agent's own brief\n")
        print("DESCRIPTION: rewrite the brief")
        return
    if mode == "crash":
        text = text.replace("LR = 0.02", "LR = 0.01", 1)
        train.write_text(text.replace('MODE = "ok"', 'MODE = "crash"', 1))
        print("DESCRIPTION: lower lr (crashes)")
        return
    train.write_text(text.replace("LR = 0.02", "LR = 0.01", 1))
    git("add", "train.py")
    git("commit", "-q", "-m", "agent: lower lr")
    print("COMMIT", git("rev-parse", "HEAD").stdout.strip())
    git("branch", "agent-branch")
    git("tag", "agent-tag")
    pushed = git("push", "origin", "HEAD:refs/heads/main")
    print("push:", pushed.returncode, pushed.stderr.strip()[:200])
    Path("__pycache__").mkdir(exist_ok=True)
    Path("__pycache__/train.cpython.pyc").write_bytes(b"\0junk")
    train.write_text(train.read_text().replace("WIDTH = 64  #", "WIDTH = 64  # kept by the agent;", 1))
    print("DESCRIPTION: lower the learning rate (agent)")


if __name__ == "__main__":
    main()
